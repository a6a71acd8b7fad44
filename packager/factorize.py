"""Activation-aware (whitened) truncated SVD, with the factors quantized in turn.

For ``W [R, C]`` and the calibration second moment ``H = E[x x^T] = L L^T``, the rank-r
``U V`` minimising the output error ``E||(W - U V) x||^2`` is the truncated SVD of the
*whitened* weight ``W L = P S Q^T``: ``U = P_r S_r^1/2``, ``V = S_r^1/2 Q_r^T L^-1``, and
the error left is exactly ``sum_{i > r} s_i^2`` (plain SVD would minimise the weight
error instead, which is not what the model feels).

The factors are then quantized: ``V`` (which reads ``x``) with GPTQ against ``H``, then
``U`` is refitted to the quantized ``V`` by least squares (``U = W H V'^T (V' H V'^T)^-1``)
and quantized with GPTQ against its own input's moment ``V' H V'^T``. The result is stored
as a LOW_RANK tensor naming its two factor tensors (spec/FORMAT.md section 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .encode import EncodedTensor, EncodingChoice
from .quantizers.gptq import gptq_quantize, output_error
from .quantizers.rtn import rtn_quantize

__all__ = [
    "LowRank",
    "add_low_rank_options",
    "factor_names",
    "factorize",
    "rank_for",
    "whitened_svd",
]

_F32 = np.float32


def factor_names(name: str) -> tuple[str, str]:
    return f"{name}.lowrank_u", f"{name}.lowrank_v"


def rank_for(fraction: float, rows: int, cols: int, multiple: int = 32) -> int:
    """``fraction`` of ``min(rows, cols)``, rounded down to a multiple (at least one)."""
    r = int(fraction * min(rows, cols)) // multiple * multiple
    return max(multiple, r)


def _whitener(h: np.ndarray, damp: float) -> np.ndarray:
    """Lower Cholesky factor ``L`` of the damped ``H`` (``H = L L^T``)."""
    n = h.shape[0]
    mean = float(np.mean(np.diag(h))) or 1.0
    for factor in (1, 10, 100, 1000):
        try:
            return np.linalg.cholesky(h + np.eye(n) * (damp * factor * mean))
        except np.linalg.LinAlgError:
            continue
    raise ValueError("the calibration Hessian is not positive definite even when damped")


def whitened_svd(
    w: np.ndarray, h: np.ndarray, damp: float = 0.01
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(P, s, QtLinv, L)``: ``W L = P diag(s) Q^T`` and ``Q^T L^-1`` (float64)."""
    w64 = np.asarray(w, np.float64).reshape(w.shape[0], -1)
    lo = _whitener(np.asarray(h, np.float64), damp)
    p, s, qt = np.linalg.svd(w64 @ lo, full_matrices=False)
    qt_linv = np.linalg.solve(lo.T, qt.T).T  # Q^T L^-1
    return p, s, qt_linv, lo


@dataclass
class LowRank:
    rank: int
    u: EncodedTensor
    v: EncodedTensor
    decoded: np.ndarray  # float32 [R, C] = U' V'
    error: float  # output error tr(dW H dW^T)


def factorize(
    w: np.ndarray,
    h: np.ndarray,
    rank: int,
    choice: EncodingChoice,
    *,
    gptq: bool = True,
    damp: float = 0.01,
    svd: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> LowRank:
    """Rank-``rank`` factors of ``w``, quantized with ``choice`` (see the module)."""
    m = np.asarray(w, _F32).reshape(w.shape[0], -1)
    rows, cols = m.shape
    if not 1 <= rank <= min(rows, cols):
        raise ValueError(f"rank {rank} out of range for a {rows}x{cols} matrix")
    _, s, qt_linv, _ = svd if svd is not None else whitened_svd(m, h, damp)
    root = np.sqrt(s[:rank])
    v = (root[:, None] * qt_linv[:rank]).astype(_F32)  # [r, C]
    h64 = np.asarray(h, np.float64)
    if gptq and choice.encoding.is_group:
        v_enc, v_q = gptq_quantize(v, h64, choice, damp=damp)
    else:
        v_enc, v_q = rtn_quantize(v, choice)
    hv = v_q.astype(np.float64) @ h64 @ v_q.T.astype(np.float64)  # input moment of U
    hv += np.eye(rank) * (1e-6 * (float(np.mean(np.diag(hv))) or 1.0))
    u = np.linalg.solve(hv, (m.astype(np.float64) @ h64 @ v_q.T.astype(np.float64)).T).T
    u = u.astype(_F32)  # least-squares U for the quantized V
    if gptq and choice.encoding.is_group:
        u_enc, u_q = gptq_quantize(u, hv, choice, damp=damp)
    else:
        u_enc, u_q = rtn_quantize(u, choice)
    approx = u_q @ v_q
    return LowRank(rank, u_enc, v_enc, approx, output_error(approx - m, h))


def add_low_rank_options(
    sens: list,
    load,
    stats,
    fractions: tuple[float, ...],
    choice: EncodingChoice,
    damp: float = 0.01,
    on_tensor=None,
) -> int:
    """Add a low-rank option per rank fraction to every searchable layer weight (errors
    with RTN-quantized factors; the build quantizes the chosen ones with GPTQ). Ranks
    whose factors would not be smaller than the tensor's largest option are skipped.
    Returns the number of options added."""
    from .sensitivity import Option, padded_bytes

    added = 0
    multiple = max(32, choice.group_size or 0)
    for t in sens:
        if t.fixed is not None or t.layer is None or len(t.shape) != 2:
            continue
        site = stats.site(t.name) if stats is not None else None
        if site is None:
            continue
        rows, cols = t.shape
        biggest = max(o.nbytes for o in t.options)
        ranks = sorted({rank_for(f, rows, cols, multiple) for f in fractions})
        ranks = [r for r in ranks if r < min(rows, cols)]
        if not ranks:
            continue
        w = load(t.name).reshape(rows, cols)
        h = site.mean_hessian
        svd = whitened_svd(w, h, damp)
        for r in ranks:
            nbytes = padded_bytes(choice, (rows, r)) + padded_bytes(choice, (r, cols))
            if nbytes >= biggest:
                continue
            if choice.encoding.is_group and r % choice.group_size:
                continue
            lr = factorize(w, h, r, choice, gptq=False, damp=damp, svd=svd)
            mse = float(np.mean((lr.decoded - w) ** 2))
            t.options.append(Option(choice, nbytes, lr.error, mse, 0.0, rank=r))
            added += 1
        if on_tensor:
            on_tensor(t.name)
    return added
