"""Human and JSON views of a package header for `edgepack inspect`."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from edgepack.format import Encoding, Package
from edgepack.format.errors import SignatureError
from edgepack.format.model_card import CARD_FIELDS, read_model_card
from edgepack.format.signing import parse_signature_block

from .describe_adapters import adapter_lines, adapters_to_json
from .describe_prefix import describe_prefix_caches, prefix_caches_json


def _encoding_label(t) -> str:
    """The label the CLI and recipes use for this tensor's encoding (``int4-g32-asym``)."""
    return t.encoding.info.label(t.group_size)


def header_to_json(pkg: Package) -> dict[str, Any]:
    h, pre = pkg.header, pkg.preamble
    return {
        "path": str(pkg.path),
        "format_version": f"{pre.format_major}.{pre.format_minor}",
        "min_runtime_version": h.min_runtime_version,
        "quantization_schema_version": h.quantization_schema_version,
        "operator_set_version": h.operator_set_version,
        "required_operators": [{"name": n, "version": v} for n, v in h.required_operators],
        "required_features": list(h.required_features),
        "identity": {
            "name": h.identity.name,
            "version": h.identity.version,
            "architecture": h.identity.architecture,
            "config": h.identity.config,
        },
        "provenance": {
            "tool": h.provenance.tool,
            "tool_version": h.provenance.tool_version,
            "source_name": h.provenance.source_name,
            "source_sha256": h.provenance.source_sha256,
            "recipe": h.provenance.recipe,
        },
        "model_card": read_model_card(pkg),
        "header_digest": pre.header_digest.hex(),
        "signed": pre.signed,
        "signature_key_ids": _signer_ids(pkg),
        "sections": [
            {
                "kind": s.kind_name,
                "name": s.name,
                "media_type": s.media_type,
                "stored_bytes": s.data.length,
                "bytes": s.uncompressed_length,
                "compression": s.compression.name.lower()
                if hasattr(s.compression, "name")
                else int(s.compression),
                "required": s.required,
                "sha256": s.hash.hex(),
            }
            for s in h.sections
        ],
        "adapters": adapters_to_json(pkg),
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "encoding": _encoding_label(t),
                "bytes": t.nbytes,
                "offset": t.codes.offset,
                "sha256": t.hash.hex(),
                **({"factors": list(t.factors), "rank": t.rank} if t.factors else {}),
            }
            for t in h.tensors
        ],
        "prefix_caches": prefix_caches_json(pkg),
    }


def describe_header(pkg: Package) -> str:
    h, pre = pkg.header, pkg.preamble
    size = pkg.path.stat().st_size
    lines = [
        f"{pkg.path}  ({size:,} bytes)",
        f"  model        {h.identity.name} {h.identity.version} ({h.identity.architecture})",
        f"  format       {pre.format_major}.{pre.format_minor}   min runtime "
        f"{h.min_runtime_version}   quant schema {h.quantization_schema_version}   "
        f"opset {h.operator_set_version}",
        "  operators    " + ", ".join(f"{n}@{v}" for n, v in h.required_operators),
        f"  provenance   {h.provenance.tool} {h.provenance.tool_version} from "
        f"{h.provenance.source_name or '?'} (sha256 {h.provenance.source_sha256[:16]})",
        *_shape_lines(h.identity.config),
        f"  signature    {_signers(pkg)}   header sha256 {pre.header_digest.hex()[:16]}",
    ]
    lines += _card_lines(read_model_card(pkg))
    lines += [f"  sections     {len(h.sections)}"]
    for s in h.sections:
        comp = " zstd" if s.compression else ""
        lines.append(
            f"    {s.kind_name:<18} {s.name:<20} {s.uncompressed_length:>12,} B"
            f"{comp}{' (required)' if s.required else ''}"
        )
    lines += adapter_lines(adapters_to_json(pkg))
    per_enc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    total_params = 0
    for t in h.tensors:
        n = math.prod(t.shape)
        if t.encoding != Encoding.LOW_RANK:
            total_params += n
        row = per_enc[_encoding_label(t)]
        row[0] += 1
        row[1] += n
        row[2] += t.nbytes
    total_bytes = sum(r[2] for r in per_enc.values())
    bpw = 8 * size / total_params if total_params else 0.0
    lines.append(
        f"  tensors      {len(h.tensors)}, {total_params:,} parameters, "
        f"{total_bytes:,} bytes of tensor data, {bpw:.2f} bits/weight (whole file)"
    )
    for label, (count, params, nbytes) in sorted(per_enc.items()):
        lines.append(f"    {label:<22} {count:>5} tensors {params:>14,} params {nbytes:>14,} B")
    lines += describe_prefix_caches(pkg)
    return "\n".join(lines)


def _shape_lines(config: dict[str, Any]) -> list[str]:
    """Layers, width, heads, context and vocabulary, as the model config states them."""
    def value(key: str) -> str:
        v = config.get(key)
        return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else "?"

    if not any(k in config for k in ("num_hidden_layers", "hidden_size", "vocab_size")):
        return []
    return [
        f"  shape        {value('num_hidden_layers')} layers, width {value('hidden_size')}, "
        f"heads {value('num_attention_heads')} (kv {value('num_key_value_heads')}), "
        f"context {value('max_position_embeddings')}, vocabulary {value('vocab_size')}"
    ]


def _signer_ids(pkg: Package) -> list[str]:
    """Key ids (hex) of the signatures the package carries (not checked here: `verify`)."""
    if not pkg.preamble.signed:
        return []
    try:
        return [e.key_id.hex() for e in parse_signature_block(pkg.signature_block())]
    except SignatureError:
        return []


def _signers(pkg: Package) -> str:
    if not pkg.preamble.signed:
        return "none"
    ids = _signer_ids(pkg)
    if not ids:
        return "present (block unreadable: run verify)"
    return f"signed by key id {', '.join(i[:16] for i in ids)} (checked by verify)"


def _card_lines(card: dict[str, Any] | None) -> list[str]:
    """The model card, one field a line (long text cut to one line)."""
    if not card:
        return ["  model card   none"]
    out = ["  model card"]
    for name in CARD_FIELDS:
        if card.get(name):
            text = " ".join(str(card[name]).split())
            text = text if len(text) <= 90 else text[:87] + "..."
            out.append(f"    {name.replace('_', ' '):<14} {text}")
    return out
