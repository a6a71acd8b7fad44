"""edgepack.server.store: where packages, deltas and release metadata live.

``open_store(url)`` picks the backend from the URL:

* ``/path``, ``./path`` or ``file:///path`` - :class:`LocalStore`, a directory (the
  embedded default);
* ``s3://bucket[/prefix]`` - :class:`S3Store`, any S3-compatible endpoint, configured
  from the usual AWS environment (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``...) or
  ``endpoint_url``.

Both implement :class:`Store` (see ``base.py`` for the contract).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..errors import InvalidStoreURLError
from .base import OBJECTS_PREFIX, ObjectInfo, Store, check_key, object_key, sha256_file
from .local import LocalStore

__all__ = [
    "OBJECTS_PREFIX",
    "LocalStore",
    "ObjectInfo",
    "S3Store",
    "Store",
    "check_key",
    "object_key",
    "open_store",
    "sha256_file",
]


def open_store(
    url: str | os.PathLike[str],
    *,
    endpoint_url: str | None = None,
    create: bool = True,
    **s3_options: object,
) -> Store:
    """Open the store at ``url``; ``create`` makes a missing local directory."""
    text = os.fspath(url)
    if not text:
        raise InvalidStoreURLError("empty store URL")
    if text.startswith("s3://"):
        parsed = urlparse(text)
        bucket = parsed.netloc
        if not bucket or parsed.query or parsed.fragment:
            raise InvalidStoreURLError(f"invalid S3 store URL {text!r} (s3://bucket[/prefix])")
        from .s3 import S3Store

        try:
            return S3Store(
                bucket,
                unquote(parsed.path).strip("/"),
                endpoint_url=endpoint_url,
                **s3_options,  # type: ignore[arg-type]
            )
        except ValueError as exc:
            raise InvalidStoreURLError(f"invalid S3 store URL {text!r}: {exc}") from None
    if text.startswith("file://"):
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidStoreURLError(f"file URL with a remote host: {text!r}")
        return LocalStore(Path(unquote(parsed.path)), create=create)
    if "://" in text:
        raise InvalidStoreURLError(
            f"unsupported store URL {text!r} (use a path, file:///path or s3://bucket/prefix)"
        )
    return LocalStore(Path(text), create=create)


def __getattr__(name: str) -> object:  # S3Store without importing boto3 eagerly
    if name == "S3Store":
        from .s3 import S3Store

        return S3Store
    raise AttributeError(name)
