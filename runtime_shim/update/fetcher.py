"""The network layer: python-tuf's ``FetcherInterface`` plus what it lacks.

ngclient fetches metadata through :meth:`RangeFetcher._fetch` (the template method; the
base class enforces ``max_length``). Payloads go through :meth:`RangeFetcher.open`,
which adds an HTTP ``Range`` start with ``If-Range`` on the strong ETag (so a resumed
download never splices two versions of an object), a bandwidth cap, a per-byte progress
callback, and the slow-retrieval bound of :class:`UpdateConfig`. Nothing here decides
what to fetch or trusts a byte: that is :mod:`.download` and :mod:`.updater`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import urllib3
from tuf.api import exceptions as tuf_exc
from tuf.ngclient.fetcher import FetcherInterface

from .config import UpdateConfig
from .errors import DownloadError, DownloadHTTPError, DownloadLengthError, SlowRetrievalError

__all__ = ["RangeFetcher", "RangeResponse"]

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


@dataclass
class RangeResponse:
    """An open payload response: ``start`` is the offset of its first byte."""

    status: int
    start: int
    etag: str | None
    chunks: Iterator[bytes]


class RangeFetcher(FetcherInterface):
    """urllib3 with the config's timeouts; one connection pool per updater."""

    def __init__(self, config: UpdateConfig, user_agent: str = "edgepack-update") -> None:
        self.config = config
        self._pool = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=config.connect_timeout, read=config.read_timeout),
            retries=False,
            headers={"user-agent": user_agent},
        )

    # -- ngclient's template method (metadata) -----------------------------------------------
    def _fetch(self, url: str) -> Iterator[bytes]:
        try:
            resp = self._request("GET", url)
        except DownloadHTTPError as e:
            raise tuf_exc.DownloadHTTPError(str(e), e.status_code) from None
        except SlowRetrievalError as e:
            raise tuf_exc.SlowRetrievalError(str(e)) from None
        return self._chunks(resp, None)

    # -- payloads --------------------------------------------------------------------------
    def open(
        self,
        url: str,
        start: int = 0,
        if_range: str | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> RangeResponse:
        """GET ``url`` from byte ``start``; a 200 means the server sent the whole object
        (it changed, or ignores ranges) and the caller starts over."""
        headers = {}
        if start:
            headers["range"] = f"bytes={start}-"
            if if_range:
                headers["if-range"] = if_range
        resp = self._request("GET", url, headers)
        etag = resp.headers.get("etag")
        if etag is not None and etag.startswith("W/"):
            etag = None  # a weak ETag cannot guard a byte range
        first = 0
        if resp.status == 206:
            m = _CONTENT_RANGE.match(resp.headers.get("content-range", ""))
            if m is None or int(m[1]) != start:
                resp.release_conn()
                raise DownloadError(f"{url}: the server answered a range other than bytes={start}-")
            first = start
        return RangeResponse(resp.status, first, etag, self._chunks(resp, on_bytes))

    def post_json(self, url: str, body: dict[str, Any], max_bytes: int) -> tuple[int, Any]:
        """POST a JSON body; (status, decoded answer) for 2xx and 4xx answers."""
        data = json.dumps(body).encode()
        try:
            resp = self._pool.request(
                "POST",
                url,
                body=data,
                headers={"content-type": "application/json"},
                preload_content=False,
                redirect=False,
            )
        except urllib3.exceptions.HTTPError as e:
            raise _network_error(url, e) from None
        try:
            raw = b"".join(self._chunks(resp, None, max_bytes))
        finally:
            resp.release_conn()
        if resp.status >= 500:
            raise DownloadHTTPError(f"{url}: HTTP {resp.status}", resp.status)
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            raise DownloadError(f"{url}: the answer is not JSON", retriable=False) from None

    def close(self) -> None:
        self._pool.clear()

    # -- internals -------------------------------------------------------------------------
    def _request(self, method: str, url: str, headers: dict[str, str] | None = None):
        try:
            resp = self._pool.request(
                method, url, headers=headers, preload_content=False, redirect=True
            )
        except urllib3.exceptions.HTTPError as e:
            raise _network_error(url, e) from None
        if resp.status >= 400:
            resp.drain_conn()
            raise DownloadHTTPError(f"{url}: HTTP {resp.status}", resp.status)
        return resp

    def _chunks(
        self, resp: Any, on_bytes: Callable[[int], None] | None, max_bytes: int | None = None
    ) -> Iterator[bytes]:
        """The body in reads of at most ``read_bytes``, paced by the bandwidth cap and cut
        off when slower than ``min_bytes_per_second`` after ``slow_grace``."""
        cfg = self.config
        began = time.monotonic()
        received = 0
        try:
            while True:
                try:
                    chunk = resp.read1(cfg.read_bytes)
                except urllib3.exceptions.TimeoutError:
                    raise SlowRetrievalError(
                        f"no byte for {cfg.read_timeout:g} s from the server"
                    ) from None
                except urllib3.exceptions.HTTPError as e:
                    raise _network_error("the download", e) from None
                if not chunk:
                    return
                received += len(chunk)
                if max_bytes is not None and received > max_bytes:
                    raise DownloadLengthError(
                        f"the server sent more than {max_bytes} bytes", retriable=False
                    )
                elapsed = time.monotonic() - began
                if elapsed > cfg.slow_grace and received / elapsed < cfg.min_bytes_per_second:
                    raise SlowRetrievalError(
                        f"{received} bytes in {elapsed:.0f} s: slower than "
                        f"{cfg.min_bytes_per_second} B/s"
                    )
                if cfg.max_bytes_per_second:
                    ahead = received / cfg.max_bytes_per_second - elapsed
                    if ahead > 0:
                        time.sleep(ahead)
                if on_bytes is not None:
                    on_bytes(len(chunk))
                yield chunk
        finally:
            resp.release_conn()


def _network_error(url: str, exc: Exception) -> DownloadError:
    if isinstance(exc, urllib3.exceptions.TimeoutError) or isinstance(
        getattr(exc, "reason", None), urllib3.exceptions.TimeoutError
    ):
        return SlowRetrievalError(f"{url}: timed out")
    return DownloadError(f"{url}: {type(exc).__name__}: {exc}")
