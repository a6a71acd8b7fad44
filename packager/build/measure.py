"""Phase 3, sensitivity: what GPTQ saves over RTN per tensor kind and encoding, and the
low-bit label the probe quantizes each tensor with (:mod:`..sensitivity` measures)."""

from __future__ import annotations

import numpy as np

from ..calibration import CalibrationStats
from ..quantizers import gptq_quantize, output_error, rtn_quantize
from ..recipe import Recipe
from ..sensitivity import TensorSensitivity
from .result import Progress
from .source import FloatModel

__all__ = ["gptq_gains", "probe_label"]

_GAIN_ROWS = 256  # rows per weight the GPTQ / RTN error ratio is measured on


def gptq_gains(
    fm: FloatModel,
    sens: list[TensorSensitivity],
    stats: CalibrationStats,
    recipe: Recipe,
    progress: Progress,
) -> dict[tuple[str, str], float]:
    """Measured GPTQ error / RTN error per (tensor kind, encoding label), on two layers.

    Rows of a weight quantize independently given the Hessian, so both errors are
    measured on the same sample of rows (a fraction of the cost)."""
    layers = sorted({t.layer for t in sens if t.layer is not None})
    if not layers:
        return {}
    picks = {layers[len(layers) // 3], layers[(2 * len(layers)) // 3]}
    todo = [t for t in sens if t.layer in picks and t.fixed is None]
    progress.phase("gptq gain", sum(len(t.options) for t in todo))
    ratios: dict[tuple[str, str], list[float]] = {}
    q = recipe.quantize
    rng = np.random.default_rng(0)
    for t in todo:
        site = stats.site(t.name)
        if site is None:
            continue
        h = site.mean_hessian
        w = fm.load(t.name).reshape(t.shape[0], -1)
        if w.shape[0] > _GAIN_ROWS:
            pick = np.sort(rng.choice(w.shape[0], _GAIN_ROWS, replace=False))
            w = np.ascontiguousarray(w[pick])
        for o in t.options:
            progress.advance(1, f"{t.name} {o.label}")
            if not o.choice.encoding.is_group or o.rank or o.err <= 0:
                continue
            _, rtn = rtn_quantize(w, o.choice)
            _, deq = gptq_quantize(
                w,
                h,
                o.choice,
                damp=q.damp,
                block_size=q.block_size,
                act_order=q.act_order,
                scale_search=q.scale_search,
            )
            base = output_error(rtn - w, h)
            if base > 0:
                ratios.setdefault((t.kind, o.label), []).append(output_error(deq - w, h) / base)
    return {k: float(np.exp(np.mean(np.log(np.maximum(v, 1e-6))))) for k, v in ratios.items()}


def probe_label(t: TensorSensitivity) -> str | None:
    """The probe quantizes with a low-bit option, where errors are well above noise."""
    prefs = ("int3-g32-s8", "int3-g32", "int3-g64", "int3-g32-asym", "int2-g32-asym", "int4-g32")
    for pref in prefs:
        if any(o.label == pref for o in t.options):
            return pref
    opts = sorted((o for o in t.options if not o.rank), key=lambda o: o.nbytes)
    return opts[0].label if opts else None

