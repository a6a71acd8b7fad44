"""Operations: request body bounds, JSON access logs, health and readiness.

Both middlewares are plain ASGI so they see every response, streamed ones included:

* :class:`BodyLimit` answers 413 before a handler runs when a body is larger than
  ``max_body_bytes`` (declared or actually sent);
* :class:`AccessLog` writes one JSON line per request to the
  ``edgepack.server.http.access`` logger: request id (``X-Request-ID`` if the caller
  sent a sane one, else fresh; echoed back), method, path, status, bytes sent, latency,
  and what the handler noted in ``request.state.access`` (hashed device id, plan). The
  raw device id is never logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

__all__ = ["AccessLog", "BodyLimit", "device_hash", "health_router"]

access_log = logging.getLogger("edgepack.server.http.access")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

Scope = dict[str, Any]


def device_hash(device_id: str) -> str:
    """What the logs say instead of a device id (stable, not reversible in practice)."""
    return hashlib.sha256(b"edgepack-log/" + device_id.encode()).hexdigest()[:16]


class BodyLimit:
    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Any, send: Any) -> None:
        response = JSONResponse(
            {
                "error": "request_too_large",
                "reason": f"request bodies are limited to {self.max_body_bytes} bytes",
            },
            status_code=413,
        )
        await response(scope, receive, send)


class AccessLog:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        sent_id = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
        request_id = sent_id if _REQUEST_ID.fullmatch(sent_id) else uuid.uuid4().hex
        noted: dict[str, Any] = {}
        scope.setdefault("state", {})["access"] = noted
        status, sent = 0, 0

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            record = {
                "request_id": request_id,
                "method": scope["method"],
                "path": scope["path"],
                "status": status or 500,
                "bytes": sent,
                "latency_ms": round((time.perf_counter() - started) * 1000, 3),
                **noted,
            }
            access_log.info(json.dumps(record, sort_keys=True))


health_router = APIRouter(tags=["operations"])


@health_router.api_route(
    "/healthz", methods=["GET", "HEAD"], summary="The process is up (no store access)."
)
async def healthz() -> dict[str, str]:  # async: answers even when every thread is busy
    return {"status": "ok"}


@health_router.api_route(
    "/readyz",
    methods=["GET", "HEAD"],
    summary="The store is reachable and its release metadata verifies.",
    responses={503: {"description": "not ready: the store or its metadata is unusable"}},
)
def readyz(request: Request) -> Any:
    from edgepack.format.errors import EdgepackError

    try:
        snap = request.app.state.view.current()
    except EdgepackError as exc:
        return JSONResponse({"status": "not ready", "reason": str(exc)}, status_code=503)
    return {"status": "ready", "timestamp_version": snap.timestamp_version}
