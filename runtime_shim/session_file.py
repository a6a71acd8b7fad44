"""Saved sessions: a session's tokens and K/V in a file, restored only where they are right.

Like llama.cpp's slot save/restore, but the file carries the same binding as a stored
prefix cache (weights digest, adapter, KV layout and version, tokenizer, template, RoPE,
shape): restoring on anything else raises :class:`~.errors.SessionMismatchError` naming
the field instead of continuing from K/V that mean something else. The body is the
PREFIX_KV_CACHE payload (format/prefix_cache.py), behind a magic and its SHA-256::

    magic "\\x89EPS\\r\\n\\x1a\\n" (8) | u32 file version | u64 body length | SHA-256 (32) | body
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgepack.format.digests import sha256
from edgepack.format.errors import CorruptPackageError
from edgepack.format.file_mode import seal_output
from edgepack.format.output_file import create_partial
from edgepack.format.prefix_cache import PrefixCache, decode_prefix_cache, encode_prefix_cache

from .errors import CorruptSessionError, InvalidRequestError, SessionMismatchError
from .prefix_cache import kv_pages, layout_mismatch, model_binding, write_pages

if TYPE_CHECKING:
    from .adapters import AdapterHandle
    from .model import Model
    from .session import Session

__all__ = ["MAX_SESSION_BYTES", "read_session_file", "restore_session", "save_session"]

_MAGIC = b"\x89EPS\r\n\x1a\n"
_HEAD = struct.Struct("<8sIQ32s")
_VERSION = 1
MAX_SESSION_BYTES = 1 << 32  # a restore reads the body whole: bound what a file may ask


def save_session(session: Session, path: str | os.PathLike[str]) -> Path:
    """Write ``session``'s tokens and K/V to ``path`` (atomically); returns the path."""
    model = session.model
    with model.lock:
        if not session.seq.tokens:
            raise InvalidRequestError("the session holds no tokens: nothing to save")
        cache = PrefixCache(
            model_binding(model, session.adapter_digest),
            np.asarray(session.seq.tokens, np.int32),
            kv_pages(session.seq),
        )
    body = encode_prefix_cache(cache)
    out = Path(path)
    fd, tmp = create_partial(out)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_HEAD.pack(_MAGIC, _VERSION, len(body), sha256(body).digest()))
            f.write(body)
            seal_output(f)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def read_session_file(path: str | os.PathLike[str]) -> PrefixCache:
    """Check and decode a saved session (:class:`CorruptSessionError` on bad bytes)."""
    with open(path, "rb") as f:
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size:
            raise CorruptSessionError(f"{path}: too short to be a saved session")
        magic, version, length, digest = _HEAD.unpack(head)
        if magic != _MAGIC:
            raise CorruptSessionError(f"{path}: not a saved edgepack session (bad magic)")
        if version != _VERSION:
            raise CorruptSessionError(f"{path}: saved-session version {version} is unknown")
        if length > MAX_SESSION_BYTES:
            raise CorruptSessionError(f"{path}: body of {length} bytes is over the limit")
        body = f.read(length + 1)
    if len(body) != length:
        raise CorruptSessionError(f"{path}: truncated or with trailing bytes")
    if sha256(body).digest() != digest:
        raise CorruptSessionError(f"{path}: hash mismatch: the file was modified")
    try:
        return decode_prefix_cache(body)
    except CorruptPackageError as exc:
        raise CorruptSessionError(f"{path}: {exc}") from None


def restore_session(
    model: Model,
    path: str | os.PathLike[str],
    adapter: AdapterHandle | None = None,
    adapter_scale: float = 1.0,
) -> Session:
    """A new session of ``model`` continuing from the one saved at ``path``; refused with
    :class:`SessionMismatchError` when the file was made for anything else."""
    from .session import Session

    cache = read_session_file(path)
    session = Session(model, adapter, adapter_scale)
    field = cache.binding.mismatch(model_binding(model, session.adapter_digest))
    if field is None:
        field = layout_mismatch(cache, model.kv_pool)
    if field is not None:
        session.close()
        raise SessionMismatchError(
            f"{path}: saved for another {field} than this model runs; it would continue "
            "from the wrong K/V, so it is not restored",
            field,
        )
    with model.lock:
        write_pages(session.seq, cache.tokens.tolist(), cache.arrays)
    return session
