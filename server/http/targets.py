"""``/targets/<path>``: release and delta bytes, by target path or consistent-snapshot name.

Two spellings reach the same content-addressed object ``objects/sha256/<hex>``:

* ``/targets/<dir>/<sha256>.<name>`` - what a TUF client with consistent snapshots asks
  for; the hash in the name is the object (no metadata needed to serve it);
* ``/targets/<target path>`` - the plain path from the targets metadata (or of an
  on-demand delta), looked up in the server's view of the metadata (so at most
  ``refresh_seconds`` stale).

The ETag is the object's SHA-256, i.e. the TUF hash; see :mod:`.payloads` for ranges.
With ``--redirect`` on an S3 store the answer is a 307 to a presigned URL of the object
instead; the S3 ETag there is never a hash the client may trust (multipart uploads have
composite ETags): it verifies the TUF hash.
"""

from __future__ import annotations

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from ..releases.fetcher import target_object_key
from ..store import object_key
from .payloads import payload_response, read_route

__all__ = ["targets_router"]

targets_router = APIRouter(tags=["tuf"])


@read_route(
    targets_router,
    "/targets/{path:path}",
    "Target bytes: single Range, strong ETag (= SHA-256), If-None-Match, If-Range.",
    {
        200: {"content": {"application/octet-stream": {}}, "description": "the whole object"},
        206: {"content": {"application/octet-stream": {}}, "description": "the range asked for"},
        307: {"description": "--redirect on S3: fetch from the presigned Location"},
        416: {"description": "the Range names no byte of the object"},
    },
)
def get_target(request: Request, path: str = Path(max_length=1024)) -> Response:
    app = request.app
    found = _resolve(request, path)
    if found is None:
        return JSONResponse(
            {"error": "not_found", "reason": f"no target {path[:200]}"}, status_code=404
        )
    key, sha256 = found
    info = app.state.store.stat(key)
    if info is None:
        return JSONResponse(
            {"error": "not_found", "reason": f"the bytes of {path[:200]} are not in the store"},
            status_code=404,
        )
    request.state.access["object"] = sha256[:16]
    presign = app.state.presign
    if presign is not None:
        return RedirectResponse(presign(key), status_code=307, headers={"etag": f'"{sha256}"'})
    return payload_response(
        app.state.store,
        key,
        sha256,
        info.size,
        {k.lower(): v for k, v in request.headers.items()},
        method=request.method,
        chunk_bytes=app.state.config.chunk_bytes,
    )


def _resolve(request: Request, path: str) -> tuple[str, str] | None:
    """(object key, sha256) of a target URL path, or None."""
    if ".." in path.split("/"):
        return None
    key = target_object_key(path)
    if key is not None:
        return key, key.rsplit("/", 1)[1]
    known = request.app.state.view.current().target(path)
    if known is None:
        ondemand = request.app.state.ondemand
        known = ondemand.target(path) if ondemand is not None else None
    if known is None:
        return None
    sha256 = known[0]
    try:
        return object_key(sha256), sha256
    except ValueError:
        return None
