"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights.

The runtime quantizes activations to int8 on the fly (per token and group). A channel
whose activations are far larger than the rest coarsens its whole group; SmoothQuant
divides every input channel by ``s_j = max|x_j|^alpha / max|W_:j|^(1-alpha)`` (the
consumers' largest weight in that column) and multiplies the weights' columns by it,
folded into the producing op exactly like AWQ (:mod:`.awq` scale sites), so the model's
function is unchanged while activation ranges flatten (``alpha`` = migration strength).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .awq import ScaleSite, _tie

__all__ = ["smooth_scales"]

_F32 = np.float32


def smooth_scales(
    site: ScaleSite,
    weights: Mapping[str, np.ndarray],
    act_max: np.ndarray,
    alpha: float = 0.5,
) -> np.ndarray:
    """Per-input-channel ``s`` of ``site`` (1 where a channel never fires)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"smoothquant alpha must be in [0, 1], got {alpha}")
    w_max = None
    for c in site.consumers:
        w = np.abs(np.asarray(weights[c], _F32).reshape(weights[c].shape[0], -1)).max(axis=0)
        w_max = w if w_max is None else np.maximum(w_max, w)
    a = np.asarray(act_max, np.float64)
    wm = np.asarray(w_max, np.float64)
    ok = (a > 0) & (wm > 0)
    s = np.ones_like(a)
    s[ok] = a[ok] ** alpha / wm[ok] ** (1 - alpha)
    s[ok] /= np.exp(np.mean(np.log(s[ok])))  # geometric mean 1: norms keep their scale
    s = np.clip(s, 1e-4, 1e4)
    return _tie(site, s.astype(_F32))
