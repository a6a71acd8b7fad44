"""One digest naming a package's weights, for everything bound to them.

Adapters, prefix KV caches and saved sessions are only correct on the exact weights they
were made with. The header already holds a SHA-256 of every tensor's bytes, so the
digest hashes those records (name, encoding, shape, grouping, factors and tensor hash)
in name order: it is cheap (no tensor byte is read), changes whenever any stored weight
changes, and does not change when only sections, metadata or the signature do.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from .digests import sha256
from .header import TensorEntry

_DOMAIN = b"edgepack-weights-digest-v1\x00"


def weights_digest(tensors: Iterable[TensorEntry]) -> bytes:
    """SHA-256 over the tensor records of a header, in name order (32 bytes)."""
    h = sha256(_DOMAIN)
    for t in sorted(tensors, key=lambda entry: entry.name):
        _add_bytes(h, t.name.encode("utf-8"))
        h.update(struct.pack("<HIII", int(t.encoding), len(t.shape), t.group_size, t.rank))
        h.update(struct.pack(f"<{len(t.shape)}Q", *t.shape))
        h.update(struct.pack("<I", len(t.factors)))
        for factor in t.factors:
            _add_bytes(h, factor.encode("utf-8"))
        _add_bytes(h, t.hash)
    return h.digest()


def _add_bytes(h, data: bytes) -> None:
    h.update(struct.pack("<I", len(data)))
    h.update(data)


__all__ = ["weights_digest"]
