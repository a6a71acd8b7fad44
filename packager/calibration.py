"""Calibration: sample token windows, run them through the runtime's float path, and keep
per-linear input statistics (never the activations themselves).

* :func:`calibration_texts` reads a text or JSONL file (default: ``pydoc_data.topics``,
  sorted keys ``[:40]``, the split the bars calibrate on);
* :func:`make_samples` cuts ``n`` windows of mixed length (log-uniform between
  ``min_tokens`` and ``max_tokens``) spread evenly over the tokenized text;
* :func:`collect_statistics` opens a float package as the runtime's float reference and
  runs it under :func:`edgepack.runtime_shim.instrument.observe_matmuls`, with an
  :class:`InputCapture` folding every matmul input into the statistics of that weight's
  *site* (q/k/v share one input, gate/up another). Samples stream through one at a
  time, so memory is the statistics: per site a Hessian ``X^T X`` (``K x K`` float32), the
  per-channel mean ``|x|`` and max ``|x|``, and a small reservoir of input rows.

Sites are named after the weight that reads them: ``layers.i.attn_q.weight`` for q/k/v,
``layers.i.attn_o.weight``, ``layers.i.ffn_gate.weight`` for gate/up,
``layers.i.ffn_down.weight`` and the head's tensor (``output.weight``, or
``embed.weight`` when tied).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgepack.runtime_shim import Model
from edgepack.runtime_shim.instrument import observe_matmuls, open_float_reference

from .errors import CalibrationError

__all__ = [
    "CalibrationStats",
    "InputCapture",
    "SiteStats",
    "calibration_texts",
    "collect_statistics",
    "default_calibration_text",
    "make_samples",
    "site_of",
]

_SHARED_INPUT = {"attn_k": "attn_q", "attn_v": "attn_q", "ffn_up": "ffn_gate"}
_RESERVOIR = 64  # input rows kept per site (direct output-error checks, AWQ grids)
_FLUSH_ELEMS = 1 << 17  # buffered input elements per site before X^T X is updated


def default_calibration_text() -> str:
    """``pydoc_data.topics`` (stdlib), sorted keys ``[:40]``, joined by blank lines."""
    import pydoc_data.topics as topics

    keys = sorted(topics.topics)
    return "\n\n".join(topics.topics[k] for k in keys[:40])


_JSONL_FIX = 'make every line a JSON object with a "text" string, or a JSON string'
_CALIB_FIX = "give a UTF-8 text file, or a .jsonl file of documents"


def calibration_texts(path: str | Path | None) -> list[str]:
    """Documents of a calibration file: a ``.jsonl`` file gives one per line (its ``text``
    field, or the first string field), anything else is one document. None: the default.

    A file the caller gave that cannot be used raises :class:`CalibrationError` naming
    the file, the line and the fix (the CLI's usage exit)."""
    if path is None:
        return [default_calibration_text()]
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        msg = f"{p.name} is not UTF-8 text ({exc.reason}): {_CALIB_FIX}"
        raise CalibrationError(msg) from None
    if p.suffix.lower() not in (".jsonl", ".ndjson"):
        if not raw.strip():
            raise CalibrationError(f"{p.name} is empty: {_CALIB_FIX}")
        return [raw]
    docs = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            msg = f"{p.name} line {n}: not JSON ({exc}): {_JSONL_FIX}"
            raise CalibrationError(msg) from None
        if isinstance(obj, str):
            docs.append(obj)
        elif isinstance(obj, dict):
            text = obj.get("text")
            if not isinstance(text, str):
                text = next((v for v in obj.values() if isinstance(v, str)), None)
            if text is None:
                raise CalibrationError(f"{p.name} line {n}: no text field: {_JSONL_FIX}")
            docs.append(text)
        else:
            msg = f"{p.name} line {n}: expected an object or a string: {_JSONL_FIX}"
            raise CalibrationError(msg)
    if not docs:
        raise CalibrationError(f"{p.name}: no documents: {_JSONL_FIX}")
    return docs


def make_samples(
    docs: Sequence[Sequence[int]],
    n: int,
    min_tokens: int,
    max_tokens: int,
    seed: int = 0,
    bos: int | None = None,
) -> list[list[int]]:
    """``n`` windows of mixed length from tokenized documents, deterministic in ``seed``.

    Lengths are log-uniform in ``[min_tokens, max_tokens]``; when the text is shorter than
    their sum they shrink proportionally (never below ``min_tokens``; then fewer windows).
    Windows never cross a document boundary and are spread evenly; ``bos`` (when the model
    uses one) is put first in each window.
    """
    if n < 1 or min_tokens < 2 or max_tokens < min_tokens:
        raise ValueError("need n >= 1 and 2 <= min_tokens <= max_tokens")
    rng = np.random.default_rng(seed)
    extra = 1 if bos is not None else 0
    lo, hi = math.log(min_tokens), math.log(max_tokens)
    lengths = np.exp(rng.uniform(lo, hi, n)).round().astype(int) - extra
    lengths = np.clip(lengths, max(1, min_tokens - extra), max_tokens)
    docs = [list(d) for d in docs if len(d) >= 2]
    total = sum(len(d) for d in docs)
    if total == 0:
        raise ValueError("calibration text is empty after tokenization")
    if lengths.sum() > total:
        lengths = np.maximum((lengths * (total / lengths.sum())).astype(int), min_tokens - extra)
        while lengths.sum() > total and len(lengths) > 1:
            lengths = lengths[:-1]
    # lay the windows out over the concatenated documents with equal gaps
    gap = (total - int(lengths.sum())) / max(len(lengths), 1)
    bounds = np.cumsum([0] + [len(d) for d in docs])
    out = []
    pos = 0.0
    for length in lengths:
        start = int(pos)
        k = int(np.searchsorted(bounds, start, side="right")) - 1
        doc, off = docs[k], start - int(bounds[k])
        if off + length > len(doc):  # would cross into the next document: end at its end
            off = max(0, len(doc) - int(length))
        window = doc[off : off + int(length)]
        out.append(([bos] if bos is not None else []) + window)
        pos += length + gap
    return out


def site_of(name: str) -> str:
    """The site (input) a weight reads: its own name, or the first weight sharing it."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "layers":
        parts[2] = _SHARED_INPUT.get(parts[2], parts[2])
        return ".".join(parts)
    return name


@dataclass
class SiteStats:
    """Statistics of one linear input ``x: [T, K]`` over all calibration tokens."""

    dim: int
    hessian: np.ndarray  # float32 [K, K]: sum over tokens of x x^T
    abs_sum: np.ndarray  # float64 [K]: sum |x|
    abs_max: np.ndarray  # float32 [K]: max |x|
    tokens: int = 0
    rows: list[np.ndarray] = field(default_factory=list)  # reservoir of input rows
    seen_rows: int = 0
    pending: list[np.ndarray] = field(default_factory=list)  # rows not yet in the Hessian
    pending_rows: int = 0

    @classmethod
    def empty(cls, dim: int) -> SiteStats:
        return cls(
            dim,
            np.zeros((dim, dim), np.float32),
            np.zeros(dim, np.float64),
            np.zeros(dim, np.float32),
        )

    def add(self, x: np.ndarray, rng: np.random.Generator) -> None:
        x = np.ascontiguousarray(x, np.float32)
        # X^T X is far faster on a few hundred rows than on one short sample: buffer
        self.pending.append(x)
        self.pending_rows += x.shape[0]
        if self.pending_rows * self.dim >= _FLUSH_ELEMS:
            self.flush()
        ax = np.abs(x)
        self.abs_sum += ax.sum(axis=0, dtype=np.float64)
        np.maximum(self.abs_max, ax.max(axis=0), out=self.abs_max)
        self.tokens += x.shape[0]
        # reservoir sampling of rows (Algorithm R, vectorized), bounded memory
        free = min(_RESERVOIR - len(self.rows), x.shape[0])
        self.rows.extend(np.array(r) for r in x[:free])
        rest = x.shape[0] - free
        if rest > 0:
            seen = self.seen_rows + free + np.arange(1, rest + 1)
            slot = (rng.random(rest) * seen).astype(np.int64)
            for i in np.flatnonzero(slot < _RESERVOIR):
                self.rows[slot[i]] = np.array(x[free + i])
        self.seen_rows += x.shape[0]

    def flush(self) -> None:
        if self.pending:
            x = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
            self.hessian += x.T @ x
            self.pending.clear()
            self.pending_rows = 0

    @property
    def mean_hessian(self) -> np.ndarray:
        """``E[x x^T]`` (float64): the GPTQ Hessian up to a constant."""
        self.flush()
        return self.hessian.astype(np.float64) / max(self.tokens, 1)

    @property
    def mean_abs(self) -> np.ndarray:
        return (self.abs_sum / max(self.tokens, 1)).astype(np.float32)

    @property
    def sample(self) -> np.ndarray:
        return np.stack(self.rows) if self.rows else np.zeros((0, self.dim), np.float32)

    def outlier_ratio(self) -> float:
        """Largest channel max over the median channel mean |x| (activation outliers)."""
        mean = self.mean_abs
        med = float(np.median(mean))
        return float(self.abs_max.max() / med) if med > 0 else 0.0


@dataclass
class CalibrationStats:
    sites: dict[str, SiteStats] = field(default_factory=dict)
    samples: int = 0
    tokens: int = 0
    lengths: list[int] = field(default_factory=list)
    # per token, after the embedding / each layer: the residual stream's energy as a
    # typical channel sees it (K x the median channel's mean x^2: a few "massive
    # activation" channels would otherwise dominate), and the plain mean ||x||^2
    residual_energy: dict[str, float] = field(default_factory=dict)
    residual_energy_total: dict[str, float] = field(default_factory=dict)
    token_counts: np.ndarray | None = None  # occurrences of each token id
    seconds: float = 0.0
    text_source: str = ""

    def site(self, weight_name: str) -> SiteStats | None:
        return self.sites.get(site_of(weight_name))

    def report(self) -> dict:
        """The package's calibration-report section (JSON). Nothing in it depends on the
        machine or the clock, so the same inputs build the same package bytes."""
        lengths = np.asarray(self.lengths)
        return {
            "source": self.text_source,
            "samples": self.samples,
            "tokens": self.tokens,
            "length_min": int(lengths.min()) if lengths.size else 0,
            "length_median": float(np.median(lengths)) if lengths.size else 0.0,
            "length_max": int(lengths.max()) if lengths.size else 0,
            "sites": {
                name: {
                    "dim": s.dim,
                    "tokens": s.tokens,
                    "mean_abs_max": float(s.mean_abs.max()),
                    "abs_max": float(s.abs_max.max()),
                    "outlier_ratio": round(s.outlier_ratio(), 3),
                    "hessian_trace": float(np.trace(s.mean_hessian)),
                }
                for name, s in self.sites.items()
            },
            "residual_energy": self.residual_energy,
            "residual_energy_total": self.residual_energy_total,
        }


class InputCapture:
    """Records every matmul input into :class:`CalibrationStats` (an observer for
    :func:`~edgepack.runtime_shim.instrument.observe_matmuls`).

    Float activations only (the calibration runs the float path). An input shared by
    several weights (q/k/v, gate/up) is recorded once: the layer chain hands them the
    very same array object.
    """

    def __init__(self, stats: CalibrationStats, seed: int = 0):
        self.stats = stats
        self._last: dict[str, np.ndarray] = {}
        self._rng = np.random.default_rng(seed)

    def observe(self, weight_name: str, x: np.ndarray) -> None:
        site = site_of(weight_name)
        if self._last.get(site) is x:
            return
        self._last[site] = x
        s = self.stats.sites.get(site)
        if s is None:
            s = self.stats.sites[site] = SiteStats.empty(x.shape[1])
        s.add(x, self._rng)

    def end_sample(self) -> None:
        self._last.clear()


def collect_statistics(
    float_package: str | Path | Any,
    samples: Sequence[Sequence[int]],
    *,
    threads: int | None = None,
    seed: int = 0,
    on_sample: Callable[[int, int], None] | None = None,
    text_source: str = "",
) -> CalibrationStats:
    """Run ``samples`` (token ids) through a float package; statistics of every linear input.

    ``float_package``: a path, or a runtime ``Model`` already open on float weights (run on
    observed numpy kernels; its own are restored afterwards). The head is not
    evaluated (no logits are needed); its input (the final norm's output) is recorded
    from the model's collected hidden states, under the head tensor's name.
    """
    stats = CalibrationStats(text_source=text_source)
    t0 = time.perf_counter()
    own = not isinstance(float_package, Model)
    model = open_float_reference(float_package) if own else float_package
    capture = InputCapture(stats, seed)
    try:
        _run_samples(model, samples, stats, capture, threads, on_sample)
    finally:
        if own:
            model.close()
    stats.seconds = time.perf_counter() - t0
    return stats


def _run_samples(
    model: Model,
    samples: Sequence[Sequence[int]],
    stats: CalibrationStats,
    capture: InputCapture,
    threads: int | None,
    on_sample: Callable[[int, int], None] | None,
) -> None:
    """Every sample through ``model`` with its matmul inputs shown to ``capture``."""
    with observe_matmuls(model, capture.observe, threads):
        head = model.weights.output.name
        vocab = model.config.vocab_size
        counts = np.zeros(vocab, np.int64)
        energy: dict[str, np.ndarray] = {}
        for i, ids in enumerate(samples):
            ids = [int(t) for t in ids]
            seq = model.new_sequence()
            collect: dict[str, list[np.ndarray]] = {}
            try:
                model.forward(seq, ids, logits="none", collect=collect)
            finally:
                with model.lock:
                    seq.release()
            norm = np.concatenate(collect.pop("norm"))
            capture.observe(head, norm)
            capture.end_sample()
            for key, parts in collect.items():
                h = np.concatenate(parts)
                e = np.einsum("ij,ij->j", h, h, dtype=np.float64)
                energy[key] = energy[key] + e if key in energy else e
            np.add.at(counts, np.asarray(ids), 1)
            stats.samples += 1
            stats.tokens += len(ids)
            stats.lengths.append(len(ids))
            if on_sample:
                on_sample(i + 1, len(ids))
        for s in stats.sites.values():
            s.flush()
        n = max(stats.tokens, 1)
        stats.residual_energy = {k: float(np.median(v)) * v.size / n for k, v in energy.items()}
        stats.residual_energy_total = {k: float(v.sum()) / n for k, v in energy.items()}
        stats.token_counts = counts
