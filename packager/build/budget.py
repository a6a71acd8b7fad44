"""Phase 4's inputs: the size target, the bytes besides tensors known before
calibration, the floor no plan can go below, and the latency model of a LUT."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from edgepack.format import Encoding

from ..encode import EncodingChoice
from ..recipe import Recipe
from ..search import SearchError
from ..sensitivity import Option, TensorSensitivity, fit_group, padded_bytes
from .source import FloatModel

__all__ = [
    "check_size_floor",
    "fitting",
    "fixed_for",
    "fixed_overhead",
    "group_fallbacks",
    "latency_model",
    "size_target",
    "stored_size",
]

_HEADER_PER_TENSOR = 160  # flatbuffer bytes per tensor entry besides its name


def fixed_overhead(fm: FloatModel, recipe: Recipe, sections: list) -> int:
    """File bytes besides tensors that are known before calibration: preamble and header
    (rounded up to the page the data region starts on) and the static sections."""
    header = 2048 + sum(len(n) + _HEADER_PER_TENSOR for n in fm.names)
    header += len(json.dumps(recipe.to_json())) + len(json.dumps(fm.identity.config, default=str))
    overhead = -(-(128 + header) // 4096) * 4096
    return overhead + sum(stored_size(d) + 64 for _, d, _, _ in sections)


def check_size_floor(
    fm: FloatModel, recipe: Recipe, candidates: list[EncodingChoice], overhead: int
) -> None:
    """Refuse a size budget that even the smallest candidates overshoot before the
    minutes of calibration (the search would find it out only afterwards): tensor bytes
    plus the overhead known so far, a lower bound; the search still checks the file."""
    target = size_target(recipe, fm.params)
    if not target or recipe.factorize.enabled:  # low-rank options can go below any encoding
        return
    fixed = fixed_for(recipe, candidates)
    floor = overhead
    for name, shape in zip(fm.names, fm.shapes, strict=True):
        if len(shape) < 2:
            floor += padded_bytes(EncodingChoice(Encoding.F32), shape)
            continue
        cols = math.prod(shape[1:])
        pinned = fixed(name)
        fits, _ = fitting([pinned] if pinned is not None else candidates, cols)
        floor += min(padded_bytes(c, shape) for c in fits)
    if floor > target:
        raise SearchError(
            f"target {target:,} bytes for the whole file is below the smallest possible: "
            f"{floor:,} bytes with every tensor at its smallest candidate "
            f"({', '.join(c.label for c in candidates)}) or protected encoding; allow "
            "smaller encodings (e.g. int2-asym, group size 64) or raise the budget"
        )


def fitting(
    options: list[EncodingChoice], cols: int
) -> tuple[list[EncodingChoice], list[EncodingChoice]]:
    """(the options a tensor of rows of ``cols`` can take, the ones its rows rule out):
    a group size must divide the row; when none fits, int8 (measure_sensitivity's
    fallback)."""
    fits = [c for c in options if fit_group(c, cols) is not None]
    dropped = [c for c in options if c not in fits]
    return fits or [EncodingChoice(Encoding.INT8_CHANNEL)], dropped


def group_fallbacks(
    fm: FloatModel, recipe: Recipe, candidates: list[EncodingChoice]
) -> dict[str, str]:
    """Tensor name -> why some candidates (or its protected encoding) were not open to
    it: its row length is not divisible by their group size. Never silent: the build
    prints these and the report lists them."""
    fixed = fixed_for(recipe, candidates)
    out: dict[str, str] = {}
    for name, shape in zip(fm.names, fm.shapes, strict=True):
        if len(shape) < 2:
            continue
        cols = math.prod(shape[1:])
        pinned = fixed(name)
        options = [pinned] if pinned is not None else candidates
        _, dropped = fitting(options, cols)
        if dropped:
            labels = ", ".join(c.label for c in dropped)
            instead = "int8 instead" if len(dropped) == len(options) else "not used"
            out[name] = f"row length {cols} not divisible by the group of {labels}: {instead}"
    return out


def size_target(recipe: Recipe, params: int) -> int | None:
    s = recipe.search
    if s.target_size:
        return int(s.target_size)
    if s.target_bpw:
        return int(s.target_bpw * params / 8)
    return None


def stored_size(data: bytes) -> int:
    """Bytes a section takes in the file (the writer zstd-compresses when it helps)."""
    import zstandard

    if len(data) < 1024:
        return len(data)
    return min(len(data), len(zstandard.ZstdCompressor(level=19).compress(data)))


def latency_model(recipe: Recipe, lut: Any, fm: FloatModel):
    """(per-option latency function, budget for the matmuls, fixed part), or Nones."""
    s = recipe.search
    if lut is None and s.lut:
        from ..profile_device import LatencyTable

        lut = LatencyTable.load(s.lut)
    if lut is None:
        return None, None, 0.0
    from ..profile_device import model_overhead_ms

    base = model_overhead_ms(lut, fm.identity.config)
    head = "output.weight" if "output.weight" in fm.names else "embed.weight"

    def fn(t: TensorSensitivity, o: Option) -> float:
        if len(t.shape) < 2 or (t.layer is None and t.name != head):
            return 0.0
        return lut.predict(t.shape, o)

    budget = s.latency_budget_ms - base if s.latency_budget_ms else None
    return fn, budget, base


def fixed_for(
    recipe: Recipe, candidates: list[EncodingChoice]
) -> Callable[[str], EncodingChoice | None]:
    uniform = candidates[0] if len(candidates) == 1 and not recipe.factorize.enabled else None

    def fixed(name: str) -> EncodingChoice | None:
        p = recipe.protected(name)
        return p if p is not None else uniform

    return fixed

