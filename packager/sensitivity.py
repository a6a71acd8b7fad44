"""Sensitivity of every tensor to every candidate encoding, measured on calibration data.

For a weight ``W`` whose input has the calibration second moment ``H = E[x x^T]``, the
measured output error of an encoding is ``err = E||W x - Q(W) x||^2 = tr(dW H dW^T)``
(exact over every calibration token; no activations are kept). The token embedding's
lookup error is ``sum_v f_v ||dW_v||^2`` with ``f`` the calibration token frequencies.

The search needs errors of different tensors on one scale, so each tensor gets an
``importance`` turning its output error into a share of the residual stream's energy
(linearised propagation: o/down write into the residual directly; q/k/v and gate/up
reach it through o and down, so their *relative* output error is scaled by the share
of o's / down's output in the residual; the head's by its logits' energy). An optional
probe (:func:`probe_multipliers`) then measures the real effect of each tensor kind on
the output distribution (KL on a few calibration tokens, kind by kind) and rescales.

Cheap proxies are recorded beside the measurement, as the seeds list them: the Hessian
trace ``tr(H)``, the isotropic (Fisher-like) estimate ``tr(H)/K * ||dW||^2``, the
activation outlier ratio (max channel |x| over the median channel mean |x|) and the
weight kurtosis.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgepack.format import Encoding
from edgepack.format.layout import tensor_layout
from edgepack.runtime_shim.instrument import WeightOverrides, make_linear

from .calibration import CalibrationStats
from .encode import EncodedTensor, EncodingChoice, encode_tensor
from .quantizers.rtn import embedding_weights, rtn_quantize

__all__ = [
    "FakeQuantModel",
    "Option",
    "TensorSensitivity",
    "kind_of",
    "measure_plan_kl",
    "measure_sensitivity",
    "padded_bytes",
    "probe_multipliers",
    "set_importance",
    "weight_kurtosis",
]

_F32 = np.float32
# Errors are measured on a row sample (rows quantize independently; errors scale by
# R / sampled rows): enough rows for a few-% estimate, a fraction of the work.
_SAMPLE_ROWS = 384
_SAMPLE_ROWS_EMBED = 4096
_KIND = re.compile(r"^layers\.(\d+)\.(\w+)\.weight$")


def kind_of(name: str) -> tuple[str, int | None]:
    """``("attn_q", 3)`` for ``layers.3.attn_q.weight``; ``("embed", None)`` etc."""
    m = _KIND.fullmatch(name)
    if m:
        return m[2], int(m[1])
    return name.split(".")[0], None


def padded_bytes(choice: EncodingChoice, shape: tuple[int, ...]) -> int:
    """Bytes a tensor takes in a package, alignment padding included (on average)."""
    lay = tensor_layout(choice.encoding, tuple(shape), choice.group_size)
    total = 0
    for part in (lay.codes, lay.scales, lay.zeros):
        if part is None:
            continue
        n = part.nbytes
        total += n + (2048 if n >= 64 * 1024 else 32)  # page / cache-line alignment
    return total


def weight_kurtosis(w: np.ndarray) -> float:
    x = np.asarray(w, np.float64).ravel()
    x = x - x.mean()
    var = float(np.mean(x * x))
    return float(np.mean(x**4) / (var * var)) if var > 0 else 0.0


@dataclass
class Option:
    """One candidate encoding of a tensor, with its size and measured error."""

    choice: EncodingChoice
    nbytes: int
    err: float  # measured output error E||dW x||^2 (RTN), lookup error for embeddings
    weight_mse: float  # mean dW^2
    proxy: float  # tr(H)/K * ||dW||^2: the Hessian-trace (isotropic) estimate
    rank: int = 0  # low-rank options: the rank (choice is then the factors' encoding)
    extra_err: float = 0.0  # a second role's error (tied embedding used as the head)

    @property
    def label(self) -> str:
        return f"svd-r{self.rank}-{self.choice.label}" if self.rank else self.choice.label


@dataclass
class TensorSensitivity:
    name: str
    shape: tuple[int, ...]
    kind: str
    layer: int | None
    options: list[Option]
    importance: float = 1.0  # multiplier of err in the objective
    extra_importance: float = 0.0  # multiplier of extra_err (tied embedding: head role)
    fixed: EncodingChoice | None = None  # protected (or 1-D): not searched
    proxies: dict[str, float] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def cost(self, opt: Option) -> float:
        """The objective's value of ``opt``: importance-weighted error."""
        return self.importance * opt.err + self.extra_importance * opt.extra_err

    def option(self, label: str) -> Option:
        return next(o for o in self.options if o.label == label)


def fit_group(choice: EncodingChoice, cols: int) -> EncodingChoice | None:
    """``choice`` if its group size divides the row length (always for non-group ones)."""
    if not choice.encoding.is_group:
        return choice
    return choice if cols % choice.group_size == 0 else None


def _errors(
    w: np.ndarray,
    deq: np.ndarray,
    h: np.ndarray | None,
    freq: np.ndarray | None,
    rows: np.ndarray | None,
) -> tuple[float, float, float]:
    """(output error, lookup error, weight mse); on ``rows`` when sampled."""
    dw = deq - w if rows is None else deq - w[rows]
    scale = 1.0 if rows is None else w.shape[0] / len(rows)
    mse = float(np.einsum("ij,ij->", dw, dw)) / dw.size
    out = 0.0
    if h is not None:
        out = float(np.einsum("ij,ij->", dw @ h, dw)) * scale
    lookup = 0.0
    if freq is not None:
        per_row = np.einsum("ij,ij->i", dw, dw)
        f = freq if rows is None else freq[rows] * scale
        lookup = float(per_row @ f)
    return out, lookup, mse


def measure_sensitivity(
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    load: Callable[[str], np.ndarray],
    stats: CalibrationStats | None,
    candidates: Sequence[EncodingChoice],
    *,
    fixed: Callable[[str], EncodingChoice | None] = lambda name: None,
    tied_head: str | None = None,
    embed_search: bool = False,
    on_tensor: Callable[[str], None] | None = None,
    seed: int = 0,
) -> list[TensorSensitivity]:
    """Errors and sizes of every candidate for every 2-D tensor; 1-D tensors stay f32.

    ``tied_head``: the tensor that is both the embedding and the output head (its head
    error is recorded as ``extra_err``). ``embed_search``: the build quantizes the
    embedding with the weighted scale search (no GPTQ: it is looked up), so its errors
    are measured that way too (at 4 bits the search halves the head's KL on SmolLM2,
    which plain-RTN errors would not show). Importances are set by :func:`set_importance`.
    """
    rng = np.random.default_rng(seed)
    out: list[TensorSensitivity] = []
    freq = None
    if stats is not None and stats.token_counts is not None and stats.tokens:
        freq = stats.token_counts.astype(np.float64) / stats.tokens
    for name, shape in zip(names, shapes, strict=True):
        kind, layer = kind_of(name)
        if len(shape) < 2:
            f32 = EncodingChoice(Encoding.F32)
            opt = Option(f32, padded_bytes(f32, shape), 0.0, 0.0, 0.0)
            out.append(TensorSensitivity(name, shape, kind, layer, [opt], fixed=f32))
            if on_tensor:
                on_tensor(name)
            continue
        w = np.ascontiguousarray(load(name), _F32).reshape(shape[0], -1)
        rows_n, cols = w.shape
        site = stats.site(name) if stats is not None else None
        h = site.mean_hessian.astype(_F32) if site is not None else None
        is_embed = kind == "embed"
        lookup_freq = freq if is_embed and freq is not None and freq.size == rows_n else None
        if is_embed and lookup_freq is None:
            lookup_freq = np.full(rows_n, 1.0 / rows_n)
        if is_embed and name != tied_head:
            h = None  # an untied embedding is only looked up
        sample = None
        limit = _SAMPLE_ROWS_EMBED if kind in ("embed", "output") else _SAMPLE_ROWS
        if rows_n > limit:
            sample = np.sort(rng.choice(rows_n, limit, replace=False))
        trace = float(np.trace(h)) if h is not None else float(np.mean(w * w))
        proxies = {
            "hessian_trace": trace,
            "kurtosis": weight_kurtosis(w if sample is None else w[sample]),
            "outlier_ratio": site.outlier_ratio() if site is not None else 0.0,
            "output_energy": _energy(w if sample is None else w[sample], h, sample, rows_n),
        }
        pinned = fixed(name)
        choices = [pinned] if pinned is not None else list(candidates)
        opts = []
        wq = w if sample is None else np.ascontiguousarray(w[sample])
        hw = embedding_weights(h) if is_embed and embed_search else None
        for c in choices:
            fit = fit_group(c, cols)
            if fit is None:
                continue
            search = is_embed and embed_search and fit.encoding.is_group
            _, deq = rtn_quantize(wq, fit, hw, search, name=name)
            err, lookup, mse = _errors(w, deq, h, lookup_freq, sample)
            proxy = (trace / cols) * mse * w.size
            if is_embed:
                opts.append(Option(fit, padded_bytes(fit, shape), lookup, mse, proxy, 0, err))
            else:
                opts.append(Option(fit, padded_bytes(fit, shape), err, mse, proxy))
        if not opts:  # no candidate fits the row length
            c = EncodingChoice(Encoding.INT8_CHANNEL)
            _, deq = rtn_quantize(wq, c, name=name)
            err, lookup, mse = _errors(w, deq, h, lookup_freq, sample)
            opts.append(Option(c, padded_bytes(c, shape), err + lookup, mse, 0.0))
        out.append(TensorSensitivity(name, shape, kind, layer, opts, fixed=pinned, proxies=proxies))
        if on_tensor:
            on_tensor(name)
    return out


def _energy(w: np.ndarray, h: np.ndarray | None, sample, rows_n: int) -> float:
    """``E||W x||^2`` (per token), from the Hessian."""
    if h is None:
        return 0.0
    scale = 1.0 if sample is None else rows_n / len(sample)
    return float(np.einsum("ij,ij->", w @ h, w)) * scale


def set_importance(
    sens: Sequence[TensorSensitivity],
    stats: CalibrationStats | None,
    multipliers: dict[str, float] | None = None,
) -> None:
    """Put every tensor's error on one scale (see the module docstring)."""
    by_name = {s.name: s for s in sens}
    resid = stats.residual_energy if stats is not None else {}
    for s in sens:
        if s.layer is not None:
            r = resid.get(f"layers.{s.layer}", 0.0) or 1.0
            energy = s.proxies.get("output_energy", 0.0) or 1.0
            if s.kind in ("attn_o", "ffn_down"):
                s.importance = 1.0 / r
            elif s.kind in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
                sink = "attn_o" if s.kind.startswith("attn") else "ffn_down"
                o = by_name.get(f"layers.{s.layer}.{sink}.weight")
                share = (o.proxies.get("output_energy", 0.0) if o else 0.0) / r
                s.importance = (share or 1.0 / r) / energy
            else:
                s.importance = 1.0 / r
        elif s.kind == "embed":
            r = resid.get("embed", 0.0) or 1.0
            s.importance = 1.0 / r
            if any(o.extra_err for o in s.options):
                s.extra_importance = 1.0 / (s.proxies.get("output_energy", 0.0) or 1.0)
        else:  # the output head (untied): relative logit error
            s.importance = 1.0 / (s.proxies.get("output_energy", 0.0) or 1.0)
        if multipliers:
            s.importance *= multipliers.get("head" if s.kind == "output" else s.kind, 1.0)
            if s.extra_importance:
                s.extra_importance *= multipliers.get("head", 1.0)


def _kl(ref_lp: np.ndarray, lp: np.ndarray) -> float:
    """Mean over positions of ``KL(ref || q)``, a few rows at a time (bounded memory)."""
    total = 0.0
    for i in range(0, ref_lp.shape[0], 32):
        r = ref_lp[i : i + 32]
        total += float(np.sum(np.exp(r) * (r - lp[i : i + 32]), dtype=np.float64))
    return total / max(ref_lp.shape[0], 1)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """float32 log-probabilities (sums in float64)."""
    x = np.asarray(x, np.float32)
    x = x - x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    return x


def _linear(name: str, values: Any, bias: np.ndarray | None) -> Any:
    """A runtime weight holding ``values`` (see :meth:`FakeQuantModel.swap`)."""
    if isinstance(values, tuple):
        u, v = (_linear(f"{name}.{k}", p, None) for k, p in zip("uv", values, strict=True))
        return make_linear(name, Encoding.LOW_RANK, (u.rows, v.cols), bias=bias, factors=(u, v))
    if isinstance(values, EncodedTensor):
        return make_linear(
            name,
            values.choice.encoding,
            values.shape,
            values.codes,
            values.scales,
            values.zeros,
            values.choice.group_size,
            bias=bias,
        )
    values = np.ascontiguousarray(values, _F32)
    return make_linear(name, Encoding.F32, values.shape, codes=values, bias=bias)


class FakeQuantModel:
    """A float package opened on the runtime with some weights swapped for decoded
    quantized ones (float32): measures what quantizing them does to the outputs."""

    def __init__(self, model: Any) -> None:
        """``model``: a runtime ``Model`` open on float weights (not closed here)."""
        self.model = model
        self._overrides = WeightOverrides(model)

    def close(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._overrides.reset()

    def swap(self, name: str, values: Any, role: str | None = None) -> None:
        """Use ``values`` for tensor ``name``: an :class:`EncodedTensor` (kept encoded, the
        numpy kernels decode it block by block), a pair of them (low-rank factors ``U``,
        ``V``), float32 ``[R, C]``, or a 1-D float32 array for a norm weight or a bias.
        ``role`` ("embed"/"head") picks one use of a tied embedding (default: both)."""
        if isinstance(values, np.ndarray) and values.ndim == 1:
            self._overrides.set_vector(name, values)
            return
        lin = _linear(name, values, self._overrides.bias_of(name))
        self._overrides.set_linear(name, lin, role)

    def log_probs(self, ids: Sequence[int]) -> np.ndarray:
        seq = self.model.new_sequence()
        try:
            out = self.model.forward(seq, list(ids), logits="all")
        finally:
            with self.model.lock:
                seq.release()
        return _log_softmax(out)


def probe_multipliers(
    fq: FakeQuantModel,
    probe_ids: Sequence[Sequence[int]],
    sens: Sequence[TensorSensitivity],
    load: Callable[[str], np.ndarray],
    probe_label: Callable[[TensorSensitivity], str | None],
    on_kind: Callable[[str], None] | None = None,
    quantize_embedding: Callable[[TensorSensitivity, EncodingChoice], EncodedTensor] | None = None,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Per tensor kind, measured KL of quantizing every tensor of that kind (to the option
    ``probe_label`` names) over its predicted cost: the kind's importance multiplier.
    Tensors are quantized by plain RTN, the embedding by ``quantize_embedding`` when
    given (the quantizer its predicted errors were measured with).

    Returns ``(multipliers, details)``; kinds whose predicted cost is ~0 keep 1.
    """
    ref = [fq.log_probs(ids) for ids in probe_ids]
    kinds: dict[str, list[tuple[TensorSensitivity, Option, str | None]]] = {}
    for t in sens:
        if t.fixed is not None or len(t.options) < 2:
            continue
        label = probe_label(t)
        opt = next((o for o in t.options if o.label == label), None)
        if opt is None:
            continue
        if t.kind == "embed" and t.extra_importance:
            kinds.setdefault("embed", []).append((t, opt, "embed"))
            kinds.setdefault("head", []).append((t, opt, "head"))
        else:
            key = "head" if t.kind == "output" else t.kind
            kinds.setdefault(key, []).append((t, opt, None))
    mult: dict[str, float] = {}
    details: dict[str, dict[str, float]] = {}
    embedded: dict[tuple[str, str], EncodedTensor] = {}  # a tied one serves two kinds
    for kind, members in kinds.items():
        predicted = 0.0
        for t, opt, role in members:
            if t.kind == "embed" and quantize_embedding is not None:
                key = (t.name, opt.label)
                if key not in embedded:
                    embedded[key] = quantize_embedding(t, opt.choice)
                enc = embedded[key]
            else:
                enc = encode_tensor(load(t.name), opt.choice, t.name)  # RTN, kept encoded
            fq.swap(t.name, enc, role)
            predicted += (
                t.extra_importance * opt.extra_err if role == "head" else t.importance * opt.err
            )
        measured = float(
            np.mean([_kl(r, fq.log_probs(ids)) for r, ids in zip(ref, probe_ids, strict=True)])
        )
        fq.reset()
        mult[kind] = measured / predicted if predicted > 0 and measured > 0 else 1.0
        details[kind] = {"predicted": predicted, "measured_kl": measured, "multiplier": mult[kind]}
        if on_kind:
            on_kind(kind)
    return mult, details


def measure_plan_kl(
    fq: FakeQuantModel,
    probe_ids: Sequence[Sequence[int]],
    encoded: dict[str, Any],
) -> float:
    """KL of the float model with every tensor in ``encoded`` swapped in (the plan)."""
    ref = [fq.log_probs(ids) for ids in probe_ids]
    for name, values in encoded.items():
        fq.swap(name, values)
    try:
        return float(
            np.mean([_kl(r, fq.log_probs(ids)) for r, ids in zip(ref, probe_ids, strict=True)])
        )
    finally:
        fq.reset()
