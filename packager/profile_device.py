"""``edgepack profile-device``: a latency lookup table of the runtime's own kernels.

For each (matrix shape, encoding) the runtime's matmul is timed on this machine exactly
as a decode step calls it: one token, through :func:`edgepack.runtime_shim.instrument.
select_kernels` (native where built, numpy otherwise), with dynamic int8 activations for
quantized weights as the runtime does by default. Low-rank options are timed as their two
factor matmuls. Shapes come from a model (``--model PKG``: every distinct weight shape of
it) or a default grid of common LLM shapes; for any other shape the table predicts from
a per-encoding linear fit ``ms = a + b * rows * cols``.

With a model the table also stores the decode step's fixed part (norms, RoPE, attention,
embedding lookup, Python overhead, minus what the fused native layer saves over its
separately timed ops): real decode steps are timed and the predicted matmul time
subtracted, so ``predict(plan) = fixed + sum(matmul LUT)`` is comparable with the
runtime's measured latency of a built package. Every figure is a best-of (fastest
repeat or step): on a shared machine that is the statistic that stays put.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgepack.format import Encoding

from .encode import EncodingChoice, encode_tensor, parse_encoding
from .errors import LatencyTableError

__all__ = ["DEFAULT_ENCODINGS", "LatencyTable", "model_overhead_ms", "profile"]

DEFAULT_ENCODINGS = (
    "f16",
    "int8",
    "int4-g16",
    "int4-g16-asym",
    "int4-g32",
    "int4-g32-asym",
    "int4-g64",
    "int4-g64-asym",
    "int3-g16",
    "int3-g16-asym",
    "int3-g32",
    "int3-g32-asym",
    "int3-g64",
    "int3-g64-asym",
    "int2-g32-asym",
    "int2-g64-asym",
)
DEFAULT_SHAPES = (
    (576, 576),
    (192, 576),
    (1536, 576),
    (576, 1536),
    (2048, 2048),
    (5632, 2048),
    (2048, 5632),
)


@dataclass
class LatencyTable:
    """Measured ms per (rows, cols, encoding label) and per-encoding linear fits."""

    entries: dict[str, float] = field(default_factory=dict)  # "R x C encoding" -> ms
    fits: dict[str, tuple[float, float]] = field(default_factory=dict)  # label -> (a, b)
    overhead: dict[str, float] = field(default_factory=dict)  # model key -> ms per token
    kernels: str = ""
    threads: int = 1
    machine: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def key(rows: int, cols: int, label: str) -> str:
        return f"{rows}x{cols} {label}"

    def matmul_ms(self, rows: int, cols: int, label: str) -> float:
        if label.endswith("-s8") and label not in self.fits:
            label = label.removesuffix("-s8")  # 8-bit scales run the twin's kernels
        k = self.key(rows, cols, label)
        if k in self.entries:
            return self.entries[k]
        if label not in self.fits:
            raise LatencyTableError(
                f"the LUT has no timings for {label}: profile a model that uses it "
                "(`edgepack profile-device --model`) or leave it out of the recipe"
            )
        a, b = self.fits[label]
        return max(a + b * rows * cols, 0.0)

    def predict(self, shape: Sequence[int], option: Any) -> float:
        """ms of one decode-step matmul with ``option`` (an Option or EncodingChoice)."""
        rows, cols = int(shape[0]), int(math.prod(shape[1:]))
        choice = getattr(option, "choice", option)
        rank = int(getattr(option, "rank", 0) or 0)
        if rank:
            return self.matmul_ms(rank, cols, choice.label) + self.matmul_ms(
                rows, rank, choice.label
            )
        return self.matmul_ms(rows, cols, choice.label)

    def fit(self) -> None:
        by_label: dict[str, list[tuple[int, float]]] = {}
        for k, ms in self.entries.items():
            dims, label = k.split(" ", 1)
            r, c = (int(x) for x in dims.split("x"))
            by_label.setdefault(label, []).append((r * c, ms))
        for label, pts in by_label.items():
            n = np.array([p[0] for p in pts], np.float64)
            t = np.array([p[1] for p in pts], np.float64)
            if len(pts) == 1:
                self.fits[label] = (0.0, float(t[0] / n[0]))
                continue
            b, a = np.polyfit(n, t, 1)
            if b <= 0:  # noise: fall back through the origin
                a, b = 0.0, float((n @ t) / (n @ n))
            self.fits[label] = (float(a), float(b))

    def save(self, path: str | Path) -> None:
        doc = {
            "format": "edgepack-latency-lut/1",
            "kernels": self.kernels,
            "threads": self.threads,
            "machine": self.machine,
            "entries": self.entries,
            "fits": {k: list(v) for k, v in self.fits.items()},
            "overhead": self.overhead,
        }
        Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> LatencyTable:
        """Read a table ``save`` wrote; anything else raises :class:`LatencyTableError`."""
        fix = "write one with `edgepack profile-device -o FILE` on the target device"
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise LatencyTableError(f"cannot read latency table {path}: {exc}; {fix}") from None
        if not isinstance(doc, dict) or doc.get("format") != "edgepack-latency-lut/1":
            raise LatencyTableError(f"{path} is not an edgepack latency table; {fix}")
        try:
            return cls(
                entries={k: float(v) for k, v in doc["entries"].items()},
                fits={k: (float(v[0]), float(v[1])) for k, v in doc.get("fits", {}).items()},
                overhead={k: float(v) for k, v in doc.get("overhead", {}).items()},
                kernels=str(doc.get("kernels", "")),
                threads=int(doc.get("threads", 1)),
                machine=dict(doc.get("machine", {})),
            )
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
            msg = f"latency table {path} is malformed ({type(exc).__name__}: {exc}); {fix}"
            raise LatencyTableError(msg) from None


def model_key(config: dict[str, Any]) -> str:
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    keys += ("num_key_value_heads", "vocab_size")
    return "llama:" + ",".join(str(config.get(k, "?")) for k in keys)


def model_overhead_ms(lut: LatencyTable, config: dict[str, Any]) -> float:
    """The decode step's non-matmul time for this model (0 if the LUT has none)."""
    return lut.overhead.get(model_key(config), 0.0)  # may be negative (fused layers)


def _time_matmul(kernels, lin, x: np.ndarray, repeats: int) -> float:
    quantized = lin.is_quantized
    best = math.inf
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        inp = kernels.quantize_activations(x, lin.act_group) if quantized else x
        kernels.matmul(inp, lin)
        dt = time.perf_counter() - t0
        if i:  # the first call warms caches and lazy bindings
            best = min(best, dt)
    return best * 1e3


def _linear(rows: int, cols: int, choice: EncodingChoice, rng: np.random.Generator):
    from edgepack.runtime_shim.instrument import make_linear

    w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    e = encode_tensor(w, choice)
    name = f"lut.{rows}x{cols}.{choice.label}"
    return make_linear(
        name, choice.encoding, (rows, cols), e.codes, e.scales, e.zeros, choice.group_size
    )


def _model_shapes(path: str | Path) -> tuple[list[tuple[int, int]], dict[str, Any], set[str]]:
    """The model's matrix shapes, its config and the encoding labels its matrices use (the
    decode step measured for the overhead is predicted from those)."""
    from edgepack.format import Package

    with Package.open(path) as pkg:
        mats = [
            t for t in pkg.header.tensors if len(t.shape) >= 2 and t.encoding != Encoding.LOW_RANK
        ]
        shapes = sorted({(t.shape[0], math.prod(t.shape[1:])) for t in mats})
        return shapes, dict(pkg.header.identity.config), {_label_of(t) for t in mats}


def decode_ms(
    path: str | Path,
    kernels: str | None,
    threads: int | None,
    steps: int = 24,
    stat: str = "min",
) -> float:
    """Measured ms per decode step of a package (after a 32-token prefill): the fastest
    step (``stat="min"``, the statistic the LUT's entries use: best of their repeats, the
    one that survives a busy machine) or the median."""
    from edgepack.runtime_shim import open as open_model

    with open_model(path, kernels=kernels, threads=threads, verify="none") as m:
        seq = m.new_sequence()
        try:
            logits = m.forward(seq, list(range(1, 33)))
            tok = int(np.argmax(logits))
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                logits = m.forward(seq, [tok])
                times.append(time.perf_counter() - t0)
                tok = int(np.argmax(logits))
        finally:
            with m.lock:
                seq.release()
    return float((np.min(times) if stat == "min" else np.median(times)) * 1e3)


def predict_package_ms(lut: LatencyTable, path: str | Path) -> float:
    """LUT prediction of one decode step of an existing package: every layer matmul and
    the head (low-rank weights as their two factors), plus the model's fixed part."""
    from edgepack.format import Package

    total = 0.0
    with Package.open(path) as pkg:
        h = pkg.header
        factors = {f for t in h.tensors for f in t.factors}
        head = "output.weight" if "output.weight" in h.tensor_index else "embed.weight"
        for t in h.tensors:
            if len(t.shape) < 2 or t.name in factors:
                continue
            if not (t.name.startswith("layers.") or t.name == head):
                continue
            if t.encoding == Encoding.LOW_RANK:
                for f in t.factors:
                    e = pkg.entry(f)
                    total += lut.matmul_ms(e.shape[0], math.prod(e.shape[1:]), _label_of(e))
            else:
                total += lut.matmul_ms(t.shape[0], math.prod(t.shape[1:]), _label_of(t))
        total += model_overhead_ms(lut, dict(h.identity.config))
    return total


def _label_of(t) -> str:
    return EncodingChoice(t.encoding, t.group_size).label


def profile(
    model: str | Path | None = None,
    encodings: Sequence[str] = DEFAULT_ENCODINGS,
    shapes: Sequence[tuple[int, int]] | None = None,
    kernels: str | None = None,
    threads: int | None = None,
    repeats: int = 5,
    progress: Any = None,
    seed: int = 0,
) -> LatencyTable:
    """Time every (shape, encoding) with the runtime's kernels; see the module docstring."""
    from edgepack.runtime_shim.instrument import select_kernels

    config = None
    encodings = list(encodings)
    if model is not None:
        model_shapes, config, labels = _model_shapes(model)
        shapes = model_shapes if shapes is None else shapes
        encodings += sorted(labels - set(encodings))  # e.g. f32 for a float model
    elif shapes is None:
        shapes = list(DEFAULT_SHAPES)
    choices = [parse_encoding(e) for e in encodings]
    k = select_kernels(kernels, threads)
    rng = np.random.default_rng(seed)
    table = LatencyTable(
        kernels=k.name,
        threads=k.threads,
        machine={"platform": platform.platform(), "processor": platform.processor()},
    )
    jobs = [(r, c, ch) for r, c in shapes for ch in choices]
    if progress is not None:
        progress.phase("profile", len(jobs) + (1 if model is not None else 0))
    try:
        for rows, cols, ch in jobs:
            if ch.encoding.is_group and cols % ch.group_size:
                if progress is not None:
                    progress.advance(1)
                continue
            lin = _linear(rows, cols, ch, rng)
            k.bind([lin])
            x = rng.standard_normal((1, cols)).astype(np.float32)
            table.entries[table.key(rows, cols, ch.label)] = _time_matmul(k, lin, x, repeats)
            if progress is not None:
                progress.advance(1, f"{rows}x{cols} {ch.label}")
    finally:
        k.close()
    table.fit()
    if model is not None and config is not None:
        measured = min(decode_ms(model, kernels, threads) for _ in range(3))
        predicted = predict_package_ms(table, model)
        # may be negative: the fused native layer beats the sum of its timed ops
        table.overhead[model_key(config)] = measured - predicted
        if progress is not None:
            progress.advance(1, "decode step")
    return table
