"""python-tuf's exceptions -> the update client's, so callers catch one tree."""

from __future__ import annotations

from tuf.api import exceptions as tuf_exc

from edgepack.format.errors import EdgepackError

from . import errors

__all__ = ["map_tuf_error"]


def map_tuf_error(exc: BaseException) -> EdgepackError:
    """The edgepack error for a python-tuf exception (``raise map_tuf_error(e) from e``)."""
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, EdgepackError):
        return exc
    if isinstance(exc, tuf_exc.ExpiredMetadataError):
        return errors.ExpiredMetadataError(msg)
    if isinstance(exc, tuf_exc.BadVersionNumberError):
        return errors.RollbackError(msg)
    if isinstance(exc, tuf_exc.UnsignedMetadataError):
        return errors.MetadataSignatureError(msg)
    if isinstance(exc, tuf_exc.LengthOrHashMismatchError):
        return errors.TargetVerificationError(msg)
    if isinstance(exc, tuf_exc.DownloadLengthMismatchError):
        return errors.DownloadLengthError(msg, retriable=False)
    if isinstance(exc, tuf_exc.SlowRetrievalError):
        return errors.SlowRetrievalError(msg)
    if isinstance(exc, tuf_exc.DownloadHTTPError):
        return errors.DownloadHTTPError(msg, exc.status_code)
    if isinstance(exc, tuf_exc.DownloadError):
        return errors.DownloadError(msg)
    if isinstance(exc, tuf_exc.RepositoryError):
        return errors.MetadataError(msg)
    if isinstance(exc, (ValueError, OSError)):
        return errors.MetadataError(f"{type(exc).__name__}: {msg}")
    raise TypeError(f"not a python-tuf error: {type(exc).__name__}") from exc
