"""Serve content-addressed bytes over HTTP: single ranges, strong ETags, streaming.

The ETag of every payload is its SHA-256 (the store is content addressed, so it is
known without reading the bytes). Rules (RFC 9110):

* ``If-None-Match`` naming that ETag (or ``*``) -> 304, no body;
* ``Range: bytes=a-b`` / ``a-`` / ``-n`` -> 206 with ``Content-Range``; a range that
  starts past the end or does not parse -> 416 with ``Content-Range: bytes */size``;
  several ranges -> the whole object (200: RFC 9110 lets a server ignore ``Range``);
* ``If-Range`` -> the range only if it names the current ETag, else the whole object
  (a resumed download of a file that changed restarts instead of splicing);
* ``Content-Length`` always; the body is streamed from the store in chunks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter
from starlette.responses import Response, StreamingResponse

from ..store import Store

__all__ = [
    "IMMUTABLE",
    "ByteRange",
    "etag_matches",
    "parse_range",
    "payload_response",
    "read_route",
]

_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)
IMMUTABLE = "public, max-age=31536000, immutable"


def read_route(router: APIRouter, path: str, summary: str, responses: dict[int, Any]) -> Any:
    """A GET + HEAD route whose answers may be 304 and 404 besides ``responses``."""
    return router.api_route(
        path,
        methods=["GET", "HEAD"],
        summary=summary,
        responses={
            304: {"description": "unchanged (If-None-Match names its ETag)"},
            404: {"description": "not found"},
            **responses,
        },
    )


class ByteRange:
    """Half-open [start, end) within an object of ``size`` bytes."""

    __slots__ = ("end", "size", "start")

    def __init__(self, start: int, end: int, size: int) -> None:
        self.start, self.end, self.size = start, end, size

    @property
    def length(self) -> int:
        return self.end - self.start

    def content_range(self) -> str:
        return f"bytes {self.start}-{self.end - 1}/{self.size}"


class Unsatisfiable(Exception):
    """The Range header names no byte of the object (416)."""


def parse_range(header: str | None, size: int) -> ByteRange | None:
    """The single range asked for; None for the whole object."""
    if header is None:
        return None
    if not header.strip().lower().startswith("bytes"):
        return None  # another unit: ignored
    if "," in header:
        return None  # several ranges: the whole object
    m = _RANGE.fullmatch(header)
    if m is None or (m[1] == "" and m[2] == ""):
        raise Unsatisfiable(header)
    if m[1] == "":  # suffix: the last n bytes
        n = int(m[2])
        if n == 0 or size == 0:
            raise Unsatisfiable(header)
        return ByteRange(max(0, size - n), size, size)
    start = int(m[1])
    end = size if m[2] == "" else min(int(m[2]) + 1, size)
    if start >= size or (m[2] != "" and int(m[2]) < start):
        raise Unsatisfiable(header)
    return ByteRange(start, end, size)


def _etag_list(header: str) -> list[str]:
    return [t.strip() for t in header.split(",") if t.strip()]


def etag_matches(header: str, etag: str) -> bool:
    """If-None-Match comparison (weak, RFC 9110 13.1.2)."""
    tags = _etag_list(header)
    return "*" in tags or any(t.removeprefix("W/") == etag for t in tags)


def payload_response(
    store: Store,
    key: str,
    sha256: str,
    size: int,
    headers: dict[str, str],
    *,
    method: str,
    chunk_bytes: int,
    media_type: str = "application/octet-stream",
    cache_control: str = IMMUTABLE,
) -> Response:
    """The response for GET/HEAD of object ``key`` (``headers``: the request's, lower
    case names)."""
    etag = f'"{sha256}"'
    common = {"etag": etag, "accept-ranges": "bytes", "cache-control": cache_control}
    inm = headers.get("if-none-match")
    if inm is not None and etag_matches(inm, etag):
        return Response(status_code=304, headers=common)
    range_header = headers.get("range")
    if_range = headers.get("if-range")
    if range_header is not None and if_range is not None and if_range.strip() != etag:
        range_header = None  # the client's copy is of other bytes (or dated): send all
    try:
        wanted = parse_range(range_header, size)
    except Unsatisfiable:
        return Response(
            status_code=416,
            headers={**common, "content-range": f"bytes */{size}", "content-length": "0"},
        )
    status, start, length = 200, 0, size
    extra: dict[str, str] = {}
    if wanted is not None:
        status, start, length = 206, wanted.start, wanted.length
        extra["content-range"] = wanted.content_range()
    out_headers = {**common, **extra, "content-length": str(length)}
    if method == "HEAD":
        return Response(status_code=status, headers=out_headers, media_type=media_type)
    body = _stream(store, key, start, length, chunk_bytes)
    return StreamingResponse(body, status_code=status, headers=out_headers, media_type=media_type)


def _stream(store: Store, key: str, start: int, length: int, chunk_bytes: int) -> Iterator[bytes]:
    if length == 0:
        return
    yield from store.iter_bytes(key, start, length, chunk_size=chunk_bytes)
