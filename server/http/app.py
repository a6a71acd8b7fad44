"""The FastAPI app of ``edgepack serve``: one factory, every route a thin adapter.

Routes: ``POST /v1/update-check`` (the planner), ``/metadata/<file>`` (TUF metadata as
published), ``/targets/<path>`` (payloads), ``/healthz``, ``/readyz``. Everything the
app knows comes from the store (see :mod:`.view` for the bounded staleness), so any
number of replicas behind a load balancer answer alike.

Errors: a store that fails or holds no usable metadata is 503 with ``Retry-After``
(the device tries later; nothing it sent was wrong); bodies over the limit are 413;
fields out of bounds or of the wrong type are 422; a device that cannot hold the
download is 409 (:class:`~.schemas.InsufficientStorage`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgepack.format.errors import EdgepackError

from ..store import Store, open_store
from .config import ServeConfig
from .metadata import metadata_router
from .ops import AccessLog, BodyLimit, device_hash, health_router
from .planner import plan_update
from .schemas import InsufficientStorage, UpdateCheck, UpdatePlan
from .targets import targets_router
from .view import ReleaseView

__all__ = ["create_app", "create_app_from_env"]

log = logging.getLogger("edgepack.server.http")


class ErrorBody(BaseModel):
    error: str
    reason: str


def create_app(config: ServeConfig, *, store: Store | None = None) -> FastAPI:
    store = store or open_store(config.store_url, endpoint_url=config.endpoint_url, create=False)
    app = FastAPI(
        title="edgepack update server",
        version="1",
        summary="Update checks, TUF metadata and resumable payloads over an edgepack store.",
    )
    app.state.config = config
    app.state.store = store
    app.state.view = ReleaseView(store, config.refresh_seconds)
    app.state.presign = _presigner(store, config)
    app.state.ondemand = None
    if config.on_demand_deltas:
        from .ondemand import OnDemandDeltas

        app.state.ondemand = OnDemandDeltas(store, config)

    app.include_router(health_router)
    app.include_router(metadata_router)
    app.include_router(targets_router)

    @app.post(
        "/v1/update-check",
        response_model=UpdatePlan,
        tags=["updates"],
        summary="The cheapest safe plan for this device: none, adapter, delta or full.",
        responses={
            409: {"model": InsufficientStorage, "description": "free_bytes cannot hold it"},
            413: {"model": ErrorBody, "description": "request body too large"},
            503: {"model": ErrorBody, "description": "store unavailable; retry later"},
        },
    )
    def update_check(check: UpdateCheck, request: Request) -> Any:
        snap = request.app.state.view.current()
        ondemand = request.app.state.ondemand
        answer = plan_update(
            snap.index, check, on_demand=ondemand.lookup if ondemand is not None else None
        )
        noted = request.state.access
        noted["device"] = device_hash(check.device_id)
        if isinstance(answer, InsufficientStorage):
            noted["plan"] = "refused"
            return JSONResponse(answer.model_dump(), status_code=409)
        noted["plan"] = answer.plan
        noted["plan_bytes"] = answer.bytes
        return answer

    @app.exception_handler(EdgepackError)
    async def _unavailable(request: Request, exc: EdgepackError) -> JSONResponse:
        log.warning("%s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return JSONResponse(
            {"error": "unavailable", "reason": str(exc)[:1000]},
            status_code=503,
            headers={"retry-after": "5"},
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400:  # a body that is not even text: same shape as 422
            detail = [{"loc": ["body"], "msg": str(exc.detail), "type": "body_unparseable"}]
            return JSONResponse({"detail": detail}, status_code=422)
        return await http_exception_handler(request, exc)

    app.add_middleware(BodyLimit, max_body_bytes=config.max_body_bytes)
    app.add_middleware(AccessLog)
    return app


def create_app_from_env() -> FastAPI:
    """uvicorn's factory in every worker process (``edgepack serve`` sets the env)."""
    return create_app(ServeConfig.from_env())


def _presigner(store: Store, config: ServeConfig):
    if not config.redirect:
        return None
    from .redirect import presigner

    return presigner(store, config.presign_seconds)
