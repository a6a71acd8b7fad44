"""``--redirect``: presigned S3 URLs instead of streaming the bytes through the server.

The device then downloads from S3 (or the CDN in front of it) directly; Range and
If-Range work there as here. The S3 ETag it sees is never a hash to trust (a multipart
upload's ETag is a digest of part digests, and any proxy may rewrite it): the device
checks the TUF-signed SHA-256 of what it got.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import InvalidStoreURLError
from ..store import Store

__all__ = ["presigner"]


def presigner(store: Store, seconds: int) -> Callable[[str], str]:
    """``key -> URL`` valid for ``seconds``, for an S3 store."""
    if not hasattr(store, "bucket"):
        raise InvalidStoreURLError(f"--redirect needs an s3:// store, not {store.url}")
    # the store's own client and key prefixing, so the URL names exactly its object
    client, bucket, full = store._client, store.bucket, store._full  # type: ignore[attr-defined]

    def url(key: str) -> str:
        return client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": full(key)}, ExpiresIn=seconds
        )

    return url
