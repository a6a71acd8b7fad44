"""Rewrite a finished package with other sections, every tensor byte copied as stored.

Prefix KV caches are computed by running the written package, so they are added after
it exists: this copies its tensors (the stored codes, scales and zeros: no re-encoding,
so tensor hashes and the weights digest stay) and sections (re-stored with the same
compression: same bytes, same hashes, which the caches bind to), replaces the sections
of the given kinds, and signs the result once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from edgepack.format import Compression, Package, PackageWriter, SectionKind

__all__ = ["NewSection", "rewrite_with_sections"]

NewSection = tuple[SectionKind, bytes, str, str, bool | None]  # kind, data, name, media, compress


def rewrite_with_sections(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    sections: Sequence[NewSection],
    sign_keys: Sequence[object] = (),
    *,
    replace_kinds: Sequence[SectionKind] = (),
) -> Path:
    """Write ``out``: ``src`` without its sections of ``replace_kinds``, plus ``sections``."""
    drop = {int(k) for k in replace_kinds}
    with Package.open(src) as pkg:
        h = pkg.header
        with PackageWriter(
            out,
            h.identity,
            min_runtime_version=h.min_runtime_version,
            required_operators=h.required_operators,
            provenance=h.provenance,
            data_offset=pkg.preamble.data_offset,
        ) as w:
            for t in h.tensors:
                w.copy_tensor(pkg, t.name)
            for s in h.sections:
                if s.kind in drop:
                    continue
                w.add_section(
                    s.kind,
                    bytes(pkg.section_view(s)),
                    name=s.name,
                    media_type=s.media_type,
                    compress=s.compression == Compression.ZSTD,
                    required=s.required,
                )
            for kind, data, name, media, compress in sections:
                w.add_section(kind, data, name=name, media_type=media, compress=compress)
            return w.finish(sign_keys)
