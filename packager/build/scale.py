"""Phase 5, scale: SmoothQuant and AWQ for the chosen encodings, folded into the
previous ops (recorded in the float model's transforms)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..calibration import CalibrationStats
from ..quantizers.awq import awq_scales, scale_sites
from ..quantizers.smoothquant import smooth_scales
from ..recipe import Recipe
from ..search import Plan
from .result import Progress
from .source import FloatModel

__all__ = ["scale_weights"]


def scale_weights(
    fm: FloatModel,
    plan: Plan,
    stats: CalibrationStats,
    recipe: Recipe,
    progress: Progress,
) -> dict[str, Any]:
    """SmoothQuant then AWQ at every foldable site; updates ``fm.transforms`` and the
    site statistics (the scaled input's moments). Returns what was done, per site."""
    q = recipe.quantize
    sites = scale_sites(fm.names, fm.identity.config)
    progress.phase("scale", len(sites))
    done: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for site in sites:
        st = stats.sites.get(site.site)
        choices = {c: plan.choices[c] for c in site.consumers if c in plan.choices}
        if st is None or len(choices) != len(site.consumers):
            progress.advance(1)
            continue
        if any(o.rank for o in choices.values()):  # a factorized consumer: leave it
            progress.advance(1)
            continue
        ws = {c: fm.load(c) for c in site.consumers}
        entry: dict[str, Any] = {}
        if q.smoothquant > 0:
            s = smooth_scales(site, ws, st.abs_max, q.smoothquant)
            _fold(fm, stats, site, s)
            ws = {c: fm.load(c) for c in site.consumers}
            entry["smoothquant_max"] = float(s.max())
        if q.awq and not all(o.choice.encoding.is_float for o in choices.values()):
            s, err, base = awq_scales(
                site,
                ws,
                {c: o.choice for c, o in choices.items()},
                st.mean_hessian,
                st.mean_abs,
                rng=rng,
            )
            if not np.all(s == 1):
                _fold(fm, stats, site, s)
            entry["awq_error_ratio"] = err / base if base > 0 else 1.0
        done[site.site] = entry
        progress.advance(1, site.site)
    return done


def _fold(fm: FloatModel, stats: CalibrationStats, site, s: np.ndarray) -> None:
    """Record the scaling and rescale the site's statistics: ``x' = x / s``."""
    fm.transforms.fold(site, s)
    st = stats.sites[site.site]
    st.flush()
    inv = (1.0 / s).astype(np.float32)
    st.hessian *= np.outer(inv, inv)
    st.abs_sum *= inv
    st.abs_max *= inv
    st.rows = [r * inv for r in st.rows]

