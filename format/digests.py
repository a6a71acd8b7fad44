"""SHA-256 and BLAKE2b hash objects without loading OpenSSL for small inputs.

``import hashlib`` loads OpenSSL's libcrypto: +3.9 MiB resident (measured after numpy and
tokenizers) on a path, ``edgepack run --verify none``, that hashes only the header, a few
sections and KV block ids. CPython's own implementations give the same digests (its
BLAKE2b is what ``hashlib`` uses anyway); OpenSSL's SHA-256 is ~4x faster (880 vs 210
MB/s measured), so inputs from :data:`BULK_BYTES` on (tensors, large sections) still get it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BULK_BYTES", "blake2b", "sha256"]

BULK_BYTES = 4 << 20  # from here OpenSSL's speed is worth loading it (~5 ms of CPython's)

try:  # CPython's SHA-256: _sha2 from 3.12, _sha256 before (a build may leave both out)
    from _sha2 import sha256 as _small_sha256  # type: ignore[import-not-found]
except ImportError:
    try:
        from _sha256 import sha256 as _small_sha256  # type: ignore[import-not-found]
    except ImportError:
        _small_sha256 = None
try:
    from _blake2 import blake2b  # type: ignore[import-not-found]
except ImportError:
    from hashlib import blake2b


def sha256(data: bytes = b"", *, size: int | None = None) -> Any:
    """A SHA-256 hash object over ``data``; ``size``: the bytes it will be fed in all
    (default ``len(data)``), which picks OpenSSL's from :data:`BULK_BYTES` on."""
    total = len(data) if size is None else size
    if _small_sha256 is not None and total < BULK_BYTES:
        return _small_sha256(data)
    import hashlib

    return hashlib.sha256(data)
