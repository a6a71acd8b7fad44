"""`edgepack inspect` on a delta (`.epkd`): what it turns into what, and how it codes it."""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["delta_to_json", "describe_delta"]

_OPS = {0: "zero", 1: "copy", 2: "data", 3: "factors"}
_CODECS = {0: "stored", 1: "zstd", 2: "rans"}


def delta_to_json(delta: Any) -> dict[str, Any]:
    """The delta's preamble and header as plain JSON (``delta``: a DeltaFile)."""
    h, pre = delta.header, delta.preamble
    op_bytes: Counter[str] = Counter()
    for op in h.ops:
        op_bytes[_OPS.get(op.kind, str(op.kind))] += op.length
    return {
        "kind": "delta",
        "format_version": f"{pre.format_major}.{pre.format_minor}",
        "file_size": pre.file_size,
        "base": {"file_size": h.base_file_size, "sha256": h.base_file_sha256.hex()},
        "target": {"file_size": h.target_file_size, "sha256": h.target_file_sha256.hex()},
        "payload_bytes": pre.payload_length,
        "streams": dict(Counter(_CODECS.get(s.codec, str(s.codec)) for s in h.streams)),
        "ops": dict(Counter(_OPS.get(op.kind, str(op.kind)) for op in h.ops)),
        "target_bytes_by_op": dict(op_bytes),
        "signed": pre.signature_length > 0,
    }


def describe_delta(delta: Any, name: str) -> str:
    """A few lines for people: base and target, size, and how the target's bytes come."""
    j = delta_to_json(delta)
    by_op = ", ".join(f"{k} {v:,}" for k, v in sorted(j["target_bytes_by_op"].items()))
    streams = ", ".join(f"{n} {k}" for k, n in sorted(j["streams"].items())) or "none"
    ratio = j["file_size"] / max(1, j["target"]["file_size"])
    return "\n".join(
        [
            f"{name}: edgepack delta (format {j['format_version']}), {j['file_size']:,} bytes"
            f" ({ratio:.1%} of the target), {'signed' if j['signed'] else 'unsigned'}",
            f"  base    {j['base']['file_size']:,} bytes, sha256 {j['base']['sha256']}",
            f"  target  {j['target']['file_size']:,} bytes, sha256 {j['target']['sha256']}",
            f"  ops     {sum(j['ops'].values())}: target bytes by op: {by_op}",
            f"  streams {len(delta.header.streams)} ({streams}), "
            f"payload {j['payload_bytes']:,} bytes",
        ]
    )
