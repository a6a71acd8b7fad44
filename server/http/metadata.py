"""``/metadata/<file>``: the TUF metadata exactly as published in the store.

Served straight from the store on every request (no cache in the server, so a TUF
client refreshing never sees a state older than the store's): ``timestamp.json``,
``root.json`` and every ``<n>.root.json`` of the chain, and the consistent-snapshot
``<n>.snapshot.json`` / ``<n>.targets.json``. Versioned files never change once
written, so they are cacheable forever; the mutable two are ``no-cache``.
"""

from __future__ import annotations

import hashlib

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response

from ..errors import ObjectNotFoundError
from ..releases.metadata import METADATA_PREFIX
from .payloads import IMMUTABLE, etag_matches, read_route

__all__ = ["metadata_router"]

_NAME = r"^(?:[1-9][0-9]{0,9}\.)?(?:root|targets|snapshot|timestamp)\.json$"
_MAX = 16 * 1024 * 1024
metadata_router = APIRouter(tags=["tuf"])


@read_route(
    metadata_router,
    "/metadata/{name}",
    "A TUF metadata file as published (consistent snapshots, versioned roots).",
    {200: {"content": {"application/json": {}}, "description": "the signed file"}},
)
def get_metadata(
    request: Request, name: str = Path(max_length=32, pattern=_NAME)
) -> Response:
    store = request.app.state.store
    try:
        data, _ = store.get_bytes(METADATA_PREFIX + name, max_length=_MAX)
    except ObjectNotFoundError:
        return JSONResponse(
            {"error": "not_found", "reason": f"no metadata file {name}"}, status_code=404
        )
    etag = f'"{hashlib.sha256(data).hexdigest()}"'
    versioned = name[0].isdigit()
    headers = {"etag": etag, "cache-control": IMMUTABLE if versioned else "no-cache"}
    inm = request.headers.get("if-none-match")
    if inm is not None and etag_matches(inm, etag):
        return Response(status_code=304, headers=headers)
    body = b"" if request.method == "HEAD" else data
    headers["content-length"] = str(len(data))
    return Response(body, headers=headers, media_type="application/json")
