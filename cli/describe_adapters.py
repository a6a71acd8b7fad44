"""The LoRA adapters of a package, for `edgepack inspect`: base binding, rank, targets, bytes."""

from __future__ import annotations

from typing import Any

from edgepack.format import Package, SectionKind
from edgepack.format.adapter import decode_adapter, short_digest

__all__ = ["adapter_lines", "adapters_to_json"]


def adapters_to_json(pkg: Package) -> list[dict[str, Any]]:
    """One record per LORA_ADAPTER section (an empty list when there is none)."""
    sections = pkg.sections(SectionKind.LORA_ADAPTER)
    if not sections:
        return []
    own = pkg.weights_digest if pkg.header.tensors else None
    out = []
    for s in sections:
        a = decode_adapter(pkg.section(SectionKind.LORA_ADAPTER, s.name) or b"")
        out.append(
            {
                "name": a.name,
                "base_weights_digest": a.base_digest.hex(),
                "binds_this_package": own is not None and a.base_digest == own,
                "rank": a.rank,
                "alpha": a.alpha,
                "source": a.source,
                "encodings": sorted({f.encoding.info.kind for t in a.targets for f in (t.a, t.b)}),
                "targets": a.target_names,
                "bytes": s.uncompressed_length,
            }
        )
    return out


def adapter_lines(records: list[dict[str, Any]]) -> list[str]:
    """The text block of :func:`adapters_to_json`'s records."""
    if not records:
        return []
    lines = [f"  adapters     {len(records)}"]
    for r in records:
        base = short_digest(bytes.fromhex(r["base_weights_digest"]))
        where = "this package's weights" if r["binds_this_package"] else f"weights {base}"
        lines.append(
            f"    {r['name']:<20} rank {r['rank']:<4} {len(r['targets']):>4} targets "
            f"{r['bytes']:>12,} B  {'/'.join(r['encodings'])}  for {where}"
        )
    return lines
