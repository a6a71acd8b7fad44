"""Phase 6, quantize: each tensor with its chosen encoding (GPTQ or RTN, bit-exact with
the decoders), and the real output error it makes."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..calibration import CalibrationStats
from ..encode import EncodedTensor, EncodingChoice, encode_tensor
from ..factorize import factorize
from ..quantizers import gptq_quantize, output_error, rtn_quantize
from ..quantizers.rtn import embedding_weights
from ..recipe import Recipe
from ..sensitivity import Option, TensorSensitivity
from .source import FloatModel

__all__ = ["quantize", "quantize_embedding"]


def quantize(
    fm: FloatModel,
    t: TensorSensitivity,
    opt: Option,
    stats: CalibrationStats | None,
    recipe: Recipe,
) -> tuple[Any, float]:
    """Encode tensor ``t`` with ``opt``; returns the parts (a pair of factor tensors for a
    low-rank option) and the measured error (importance-weighted, like the prediction)."""
    choice = opt.choice
    q = recipe.quantize
    chunked = t.kind == "embed" and len(t.shape) == 2 and not opt.rank
    if chunked and not choice.encoding.is_float and fm.can_read_rows(t.name):
        return quantize_embedding(fm, t, choice, stats, recipe)
    w = fm.load(t.name)
    if len(t.shape) < 2 or choice.encoding.is_float:
        return encode_tensor(w, choice, t.name), 0.0
    site = stats.site(t.name) if stats is not None else None
    m = w.reshape(t.shape[0], -1)
    h = site.mean_hessian if site is not None else None
    search = q.scale_search and choice.encoding.is_group
    if opt.rank:
        if h is None:
            raise ValueError(f"{t.name}: a low-rank option needs calibration statistics")
        lr = factorize(w, h, opt.rank, choice, gptq=q.algorithm == "gptq", damp=q.damp)
        return (lr.u, lr.v), t.importance * lr.error
    if t.kind == "embed":  # looked up too: no cross-column compensation
        hd = None
        if h is not None and search:
            d = np.diag(h)
            hd = d / max(float(d.mean()), 1e-30) + 1.0
        encoded, deq = rtn_quantize(w, choice, hd, search, t.name)
    elif q.algorithm == "gptq" and h is not None and choice.encoding.is_group:
        encoded, deq = gptq_quantize(
            w,
            h,
            choice,
            damp=q.damp,
            block_size=q.block_size,
            act_order=q.act_order,
            scale_search=q.scale_search,
            name=t.name,
        )
    else:
        hd = np.diag(h) if h is not None else None
        encoded, deq = rtn_quantize(w, choice, hd, search, t.name)
    d = deq
    d -= m  # in place: the decoded copy is not needed any more
    del w, m, deq
    err = output_error(d, h) if h is not None else float(np.mean(d * d))
    if t.kind == "embed" and stats is not None and stats.token_counts is not None:
        freq = stats.token_counts / max(stats.tokens, 1)
        if freq.size == d.shape[0]:
            lookup = float(np.einsum("ij,ij->i", d, d) @ freq)
            return encoded, t.importance * lookup + t.extra_importance * err
    return encoded, t.importance * err


def quantize_embedding(
    fm: FloatModel,
    t: TensorSensitivity,
    choice: EncodingChoice,
    stats: CalibrationStats | None,
    recipe: Recipe,
) -> tuple[EncodedTensor, float]:
    """RTN (scale search weighted by the head's input moments) over row chunks: the token
    embedding is the largest tensor and is looked up, so no cross-column compensation;
    chunking keeps the build's peak memory a few MB above the rest."""
    rows = t.shape[0]
    site = stats.site(t.name) if stats is not None else None
    h = site.mean_hessian if site is not None else None
    search = recipe.quantize.scale_search and choice.encoding.is_group
    hd = embedding_weights(h) if search else None
    freq = None
    if stats is not None and stats.token_counts is not None and stats.token_counts.size == rows:
        freq = stats.token_counts / max(stats.tokens, 1)
    parts: list[EncodedTensor] = []
    head_err = lookup = 0.0
    step = 8192
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = fm.read_rows(t.name, r0, r1)
        e, deq = rtn_quantize(w, choice, hd, search, t.name)
        deq -= w
        if h is not None:
            head_err += output_error(deq, h)
        if freq is not None:
            lookup += float(np.einsum("ij,ij->i", deq, deq) @ freq[r0:r1])
        parts.append(e)
        del w, deq
    cat = [np.concatenate([getattr(p, k) for p in parts]) for k in ("codes", "scales")]
    zeros = None if parts[0].zeros is None else np.concatenate([p.zeros for p in parts])
    encoded = EncodedTensor(choice, tuple(t.shape), cat[0], cat[1], zeros)
    if freq is None:
        return encoded, t.importance * head_err
    return encoded, t.importance * lookup + t.extra_importance * head_err

