"""GELU for the numpy backend (exact and tanh forms), in float64 then rounded to float32:
the reference the activations of ``config_table.ACTIVATIONS`` are checked against."""

from __future__ import annotations

import numpy as np

__all__ = ["gelu"]

_SQRT_HALF = float(np.sqrt(0.5))
_SQRT_2_PI = float(np.sqrt(2.0 / np.pi))


def gelu(x: np.ndarray, *, tanh: bool = False) -> np.ndarray:
    """``x * Phi(x)`` (``tanh``: the tanh approximation transformers calls gelu_pytorch_tanh)."""
    g = x.astype(np.float64)
    if tanh:
        y = 0.5 * g * (1.0 + np.tanh(_SQRT_2_PI * (g + 0.044715 * g * g * g)))
    else:
        y = 0.5 * g * (1.0 + _erf(g * _SQRT_HALF))
    return y.astype(np.float32)


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7: below float32's
    resolution of GELU's output); numpy has none and scipy is not a runtime dependency."""
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (-1.453152027 + t * 1.061405429)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + poly)))
    return np.sign(x) * (1.0 - poly * np.exp(-a * a))
