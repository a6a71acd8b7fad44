"""Read a llama.cpp GGUF LoRA adapter (``convert_lora_to_gguf.py``'s output).

Its tensors are ``blk.N.attn_q.weight.lora_a`` (A ``[r, in]``) and ``.lora_b``
(B ``[out, r]``), named like the base model's GGUF tensors, with ``adapter.lora.alpha``;
the scale is ``alpha / r`` as llama.cpp applies it. For ``llama`` GGUFs llama.cpp permuted
the rows of q/k for its interleaved RoPE, so B of those is unpermuted with the base's
head counts (the rows of A are ranks, untouched), as the model importer does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ImportModelError
from .gguf_source import _PERMUTED_ARCHS, _load, _open_reader, _qk_heads, read_gguf_metadata
from .names import canonical_from_gguf, unpermute_qk
from .peft import FloatAdapter, FloatTarget

__all__ = ["is_gguf_lora", "read_gguf_lora"]

_SUFFIXES = {".lora_a": "a", ".lora_b": "b"}


def is_gguf_lora(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def read_gguf_lora(path: Path, base_config: dict[str, Any] | None) -> FloatAdapter:
    """The adapter in ``path``; ``base_config`` (the base's model config) supplies the
    head counts q/k need. ImportModelError when it is not a LoRA adapter."""
    reader = _open_reader(path)
    meta = read_gguf_metadata(reader)
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ImportModelError(f"{path.name}: not a GGUF LoRA adapter (general.type adapter)")
    alpha = meta.get("adapter.lora.alpha")
    arch = str(meta.get("general.architecture", ""))
    pairs: dict[str, dict[str, Any]] = {}
    for index, t in enumerate(reader.tensors):
        stem, part = next(
            ((t.name[: -len(s)], p) for s, p in _SUFFIXES.items() if t.name.endswith(s)),
            (t.name, None),
        )
        if part is None:
            raise ImportModelError(f"{path.name}: {t.name!r} is not a LoRA factor")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        pairs.setdefault(stem, {})[part] = _load(reader, index, shape, None)
    rank = 0
    out = FloatAdapter(path.stem, 0, 0.0, "gguf")
    for stem, ab in sorted(pairs.items()):
        if set(ab) != {"a", "b"}:
            raise ImportModelError(f"{path.name}: {stem} lacks lora_{'a' if 'b' in ab else 'b'}")
        a, b = ab["a"], ab["b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ImportModelError(f"{path.name}: {stem}: A {a.shape} and B {b.shape} do not pair")
        name = canonical_from_gguf(stem)
        heads = None
        if arch in _PERMUTED_ARCHS:
            if base_config is None and name.endswith((".attn_q.weight", ".attn_k.weight")):
                raise ImportModelError(f"{path.name}: q/k need the base's head counts")
            heads = _qk_heads(name, base_config or {})
        if heads is not None:
            b = unpermute_qk(b, heads)
        r = a.shape[0]
        rank = max(rank, r)
        scale = float(alpha) / r if alpha else 1.0  # llama.cpp: no alpha, scale 1
        out.targets[name] = FloatTarget(a, b, scale)
    if not out.targets:
        raise ImportModelError(f"{path.name}: holds no LoRA factors")
    out.rank, out.alpha = rank, float(alpha or rank)
    return out
