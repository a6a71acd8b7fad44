"""Serve a store to python-tuf's ngclient, and map its errors into edgepack's tree.

A store keeps metadata under ``metadata/`` and every target's bytes once, at
``objects/sha256/<hex>``. With consistent snapshots a TUF client asks for target
``<dir>/<name>`` as ``<dir>/<sha256>.<name>``; :func:`target_object_key` maps that URL
path back to the object, which is also what an HTTP front (``edgepack serve``, a CDN
rewrite rule ``targets/**/<hex>.* -> objects/sha256/<hex>``) does.

:class:`StoreFetcher` reads straight from a :class:`~edgepack.server.store.Store`
(local directory or S3), so ``tuf.ngclient.Updater`` can run against a store without
an HTTP server::

    updater = Updater(metadata_dir, METADATA_URL, target_dir, TARGETS_URL,
                      fetcher=StoreFetcher(store), bootstrap=trusted_root_bytes)
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import unquote, urlparse

from tuf.api import exceptions as tuf_exc
from tuf.ngclient.fetcher import FetcherInterface

from edgepack.format.errors import EdgepackError

from ..errors import (
    ExpiredMetadataError,
    MetadataSignatureError,
    ObjectNotFoundError,
    RepositoryError,
    RollbackError,
    StoreError,
)
from ..store import Store, object_key
from .metadata import METADATA_PREFIX

__all__ = [
    "METADATA_URL",
    "TARGETS_URL",
    "StoreFetcher",
    "map_tuf_error",
    "target_object_key",
]

_SCHEME = "edgepack-store"
METADATA_URL = f"{_SCHEME}:///{METADATA_PREFIX}"
TARGETS_URL = f"{_SCHEME}:///targets/"
_HASHED = re.compile(r"^(?:.*/)?([0-9a-f]{64})\.[^/]+$")


def target_object_key(url_path: str) -> str | None:
    """``targets/<dir>/<sha256>.<name>`` (or without ``targets/``) -> object key."""
    m = _HASHED.fullmatch(url_path)
    return object_key(m[1]) if m else None


class StoreFetcher(FetcherInterface):
    """ngclient fetcher reading ``edgepack-store:///metadata/...`` and
    ``edgepack-store:///targets/...`` from a store; missing objects are HTTP 404."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def _fetch(self, url: str) -> Iterator[bytes]:
        parsed = urlparse(url)
        if parsed.scheme != _SCHEME:
            raise tuf_exc.DownloadError(f"StoreFetcher cannot fetch {url}")
        path = unquote(parsed.path).lstrip("/")
        if path.startswith(METADATA_PREFIX):
            key = path
        elif path.startswith("targets/"):
            key = target_object_key(path)
            if key is None:
                raise tuf_exc.DownloadHTTPError(f"{url}: not a hash-prefixed target", 404)
        else:
            raise tuf_exc.DownloadHTTPError(f"{url}: not found", 404)
        try:
            return self.store.iter_bytes(key)
        except ObjectNotFoundError:
            raise tuf_exc.DownloadHTTPError(f"{url}: not found", 404) from None
        except ValueError:
            raise tuf_exc.DownloadHTTPError(f"{url}: not found", 404) from None


def map_tuf_error(exc: BaseException) -> EdgepackError:
    """The edgepack error for a python-tuf exception (callers: ``raise map_tuf_error(e)
    from e``), so users catch one tree."""
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, tuf_exc.ExpiredMetadataError):
        return ExpiredMetadataError(msg)
    if isinstance(exc, tuf_exc.BadVersionNumberError):
        return RollbackError(msg)
    if isinstance(exc, tuf_exc.UnsignedMetadataError):
        return MetadataSignatureError(msg)
    if isinstance(exc, tuf_exc.DownloadHTTPError):
        return StoreError(msg, retriable=exc.status_code >= 500)
    if isinstance(exc, tuf_exc.DownloadError):
        return StoreError(msg, retriable=True)
    if isinstance(exc, tuf_exc.RepositoryError):
        return RepositoryError(msg)
    if isinstance(exc, EdgepackError):
        return exc
    raise TypeError(f"not a python-tuf error: {type(exc).__name__}") from exc
