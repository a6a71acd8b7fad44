"""``edgepack build``: import -> calibrate -> sensitivity -> search -> quantize -> write.

1. **import** the source (safetensors, HF folder, GGUF, or an existing float ``.epk``) and,
   unless the source already is one, write it as a temporary float32 package; the
   runtime opens it once (float activations, float KV cache, numpy kernels) and every
   tensor is read from that mapping;
2. **calibrate**: tokenize the calibration text, cut mixed-length samples and stream them
   through the runtime's float path (:mod:`.calibration`);
3. **sensitivity** of every tensor to every candidate encoding (:mod:`.sensitivity`),
   low-rank factorizations as further candidates when enabled (:mod:`.factorize`); with
   GPTQ, the error it saves over RTN is measured per tensor kind and encoding on a few
   layers; a probe rescales every tensor kind by its measured KL;
4. **search** the assignment meeting the size (and latency) budget (:mod:`.search`);
5. **scale** (SmoothQuant, AWQ) for the chosen encodings, folded into the previous ops;
6. **quantize** each tensor with its chosen encoding (GPTQ or RTN, bit-exact with the
   decoders), measure the real output error, and **write** the package with a
   precision-plan section (per-tensor choice, sensitivities, predicted vs measured error)
   and a calibration-report section; when the file comes out above the size target the
   budget is tightened and only the tensors whose choice changed are redone;
7. **verify**: the whole plan's KL on the probe tokens (predicted vs measured), and the
   report (:mod:`.report`).

Phases report progress through a :class:`Progress` object (the CLI draws rich bars);
:class:`BuildResult` carries the summary, timings and peak memory.
"""

from __future__ import annotations

import json
import math
import os
import resource
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgepack.format import (
    Encoding,
    ModelIdentity,
    Package,
    PackageWriter,
    Provenance,
    SectionKind,
)
from edgepack.runtime_shim import runtime_version

from .calibration import CalibrationStats, calibration_texts, collect_statistics, make_samples
from .convert import required_operators
from .encode import EncodedTensor, EncodingChoice, encode_tensor, parse_encoding
from .errors import CalibrationError, QuantizedSourceError
from .factorize import add_low_rank_options, factor_names, factorize
from .quantizers import gptq_quantize, output_error, rtn_quantize
from .quantizers.awq import Transforms, awq_scales, scale_sites
from .quantizers.rtn import embedding_weights
from .quantizers.smoothquant import smooth_scales
from .recipe import Recipe
from .search import Plan, SearchError, search
from .sensitivity import (
    FakeQuantModel,
    Option,
    TensorSensitivity,
    fit_group,
    measure_plan_kl,
    measure_sensitivity,
    padded_bytes,
    probe_multipliers,
    set_importance,
)

__all__ = ["BuildResult", "Progress", "build"]

_HEADER_PER_TENSOR = 160  # flatbuffer bytes per tensor entry besides its name
_SIZE_ITERATIONS = 4
_GAIN_ROWS = 256  # rows per weight the GPTQ / RTN error ratio is measured on
_PROBE_TOKENS = 192
_GAIN_CREDIT = 0.5  # exponent of the GPTQ error ratio credited to GPTQ'd options


class Progress:
    """Phase callbacks (no-op here; the CLI draws bars)."""

    def phase(self, name: str, total: int) -> None: ...

    def advance(self, amount: int = 1, detail: str | None = None) -> None: ...

    def log(self, message: str) -> None: ...


@dataclass
class BuildResult:
    path: Path
    nbytes: int
    params: int
    plan: Plan
    phases: dict[str, float]
    peak_rss: int  # bytes
    target_size: int | None
    predicted_kl: float | None = None
    measured_kl: float | None = None
    report_path: Path | None = None
    plot_path: Path | None = None
    sensitivities: list[TensorSensitivity] = field(default_factory=list)
    measured: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    probe: dict[str, Any] = field(default_factory=dict)
    scaling: dict[str, Any] = field(default_factory=dict)

    @property
    def bpw(self) -> float:
        return self.nbytes * 8 / self.params

    def encoding_counts(self) -> dict[str, tuple[int, int]]:
        """label -> (tensors, parameters)."""
        out: dict[str, tuple[int, int]] = {}
        sizes = {t.name: t.numel for t in self.sensitivities}
        for name, opt in self.plan.choices.items():
            n, p = out.get(opt.label, (0, 0))
            out[opt.label] = (n + 1, p + sizes.get(name, 0))
        return out

    def summary(self) -> list[str]:
        lines = [f"wrote {self.path} ({self.nbytes:,} bytes, {self.bpw:.3f} bits/weight)"]
        if self.target_size:
            pct = 100 * self.nbytes / self.target_size
            lines.append(f"target {self.target_size:,} bytes: {pct:.2f} %")
        for label, (n, p) in sorted(self.encoding_counts().items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {label:<20} {n:>4} tensors {p:>14,} params")
        line = f"search {self.plan.method}: objective {self.plan.objective:.5g}"
        if "greedy_objective" in self.plan.notes:
            line += f" (greedy {self.plan.notes['greedy_objective']:.5g})"
        lines.append(line)
        if self.plan.latency_ms is not None:
            lines.append(f"predicted decode latency {self.plan.latency_ms:.2f} ms/token")
        if self.measured_kl is not None:
            lines.append(
                f"probe KL vs float: predicted {self.predicted_kl:.4g}, "
                f"measured {self.measured_kl:.4g}"
            )
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in self.phases.items())
        lines.append(f"time {sum(self.phases.values()):.1f}s ({phases})")
        lines.append(f"peak RSS {self.peak_rss / 2**20:.0f} MiB")
        return lines


# ----------------------------------------------------------------------------------------
# the float model
# ----------------------------------------------------------------------------------------
@dataclass
class _FloatModel:
    """The model as float32 tensors, read from the source; when calibration needs it, a
    float package the runtime opens once (float activations and KV cache, numpy kernels),
    from whose mapping every tensor is then read."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    identity: ModelIdentity
    tokenizer_json: str | None
    chat_template: str | None
    model_config: bytes | None
    source_name: str
    source_sha256: str
    reader: Callable[[str], np.ndarray]
    path: Path | None = None  # the float package, once there is one
    model: Any = None  # edgepack.runtime_shim.Model on it
    temporary: bool = False
    float_ready: bool = False  # ``path`` holds the complete float package
    transforms: Transforms = field(default_factory=Transforms)

    def raw(self, name: str) -> np.ndarray:
        if self.float_ready and self._float_package():
            return self._pread(name)
        return np.ascontiguousarray(self.reader(name), np.float32)

    def _float_package(self) -> bool:
        if getattr(self, "_entries", None) is None:
            with Package.open(self.path) as pkg:
                self._entries = {t.name: t for t in pkg.header.tensors}
        return all(t.encoding == Encoding.F32 for t in self._entries.values())

    def can_read_rows(self, name: str) -> bool:
        return self.float_ready and self._float_package() and name not in self.transforms.cols

    def read_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows ``r0:r1`` of a 2-D tensor of the float package (read, not mapped)."""
        t = self._entries[name]
        cols = math.prod(t.shape[1:])
        with open(self.path, "rb") as f:
            f.seek(t.codes.offset + r0 * cols * 4)
            a = np.fromfile(f, dtype="<f4", count=(r1 - r0) * cols)
        w = a.astype(np.float32, copy=False).reshape(r1 - r0, cols)
        if name in self.transforms.rows:
            w = w * self.transforms.rows[name][r0:r1, None]
        return np.ascontiguousarray(w, np.float32)

    def _pread(self, name: str) -> np.ndarray:
        """A tensor of the float32 package, read (not mapped): pages the build touches do
        not stay in its resident set."""
        t = self._entries[name]
        n = math.prod(t.shape)
        with open(self.path, "rb") as f:
            f.seek(t.codes.offset)
            a = np.fromfile(f, dtype="<f4", count=n)
        if a.size != n:
            raise ValueError(f"{name}: short read from {self.path}")
        return a.astype(np.float32, copy=False).reshape(t.shape)

    def load(self, name: str) -> np.ndarray:
        """float32 tensor, with the AWQ / SmoothQuant scalings applied."""
        w = self.raw(name)
        return self.transforms.apply(name, w) if self.transforms else w

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def ensure_model(self, workdir: Path, progress: Progress) -> None:
        """Open the float model on the runtime, writing a temporary float package first
        unless the source is one."""
        if self.model is not None:
            return
        if self.path is None:
            fd, tmp = tempfile.mkstemp(dir=workdir, prefix=".build.", suffix=".float.epk")
            os.close(fd)
            self.path, self.temporary = Path(tmp), True
            try:
                self._write_float(progress)
            except BaseException:
                self.path.unlink(missing_ok=True)
                raise
            self.reader = _no_reader  # drop the source (its mapping) for good
            self.float_ready = True
        from edgepack.runtime_shim import open as open_model

        self.model = open_model(
            self.path, kv="float", activations="float", kernels="numpy", verify="none"
        )

    def _write_float(self, progress: Progress) -> None:
        assert self.path is not None
        progress.phase("float model", len(self.names))
        ops = required_operators(self.identity.architecture, {Encoding.F32})
        prov = Provenance(
            tool="edgepack",
            tool_version=runtime_version(),
            source_name=self.source_name,
            source_sha256=self.source_sha256,
        )
        with PackageWriter(self.path, self.identity, required_operators=ops, provenance=prov) as w:
            for name in self.names:
                w.add_tensor(name, Encoding.F32, self.raw(name))
                progress.advance(1, name)
            for kind, data, sname, media in _static_sections(self):
                w.add_section(kind, data, name=sname, media_type=media)
            w.finish()

    def release_model(self) -> None:
        """Unmap the runtime's view (the file stays; :meth:`ensure_model` reopens it)."""
        if self.model is not None:
            self.model.close()
            self.model = None

    def close(self) -> None:
        self.release_model()
        if self.temporary and self.path is not None:
            self.path.unlink(missing_ok=True)


def _no_reader(name: str) -> np.ndarray:
    raise AssertionError(f"{name}: the source was released (read the float package)")


def _open_float(src: Path) -> _FloatModel:
    """The source as a :class:`_FloatModel` (nothing written yet)."""
    if src.suffix == ".epk":
        pkg = Package.open(src)
        try:
            if any(not t.encoding.is_float for t in pkg.header.tensors):
                raise QuantizedSourceError(
                    f"{src.name} is already quantized: build from the float source model "
                    "(safetensors, HF directory, GGUF or an f32/f16/bf16 package)"
                )
            h = pkg.header
            tok = pkg.section(SectionKind.TOKENIZER)
            chat = pkg.section(SectionKind.CHAT_TEMPLATE)
            prov = h.provenance
            fm = _FloatModel(
                names=[t.name for t in h.tensors],
                shapes=[tuple(t.shape) for t in h.tensors],
                identity=h.identity,
                tokenizer_json=tok.decode() if tok is not None else None,
                chat_template=chat.decode() if chat is not None else None,
                model_config=pkg.section(SectionKind.MODEL_CONFIG),
                source_name=(prov.source_name if prov else "") or src.name,
                source_sha256=(prov.source_sha256 if prov else "") or "",
                reader=lambda name: pkg.dequantize(name),
                path=src,
                float_ready=True,
            )
        except BaseException:
            pkg.close()
            raise
        fm._pkg = pkg  # type: ignore[attr-defined]  # closed with the build
        return fm
    from .importers import open_source

    source = open_source(src)
    by_name = {t.name: t for t in source.tensors}
    raw = source.config.get("source_config")
    return _FloatModel(
        names=[t.name for t in source.tensors],
        shapes=[tuple(t.shape) for t in source.tensors],
        identity=ModelIdentity(
            name=source.name,
            version="1.0.0",
            architecture=source.architecture,
            config={k: v for k, v in source.config.items() if k != "source_config"},
        ),
        tokenizer_json=source.tokenizer_json,
        chat_template=source.chat_template,
        model_config=(
            json.dumps(raw, sort_keys=True, default=str).encode() if raw is not None else None
        ),
        source_name=", ".join(p.name for p in source.source_files),
        source_sha256=source.source_sha256,
        reader=lambda name: by_name[name].load(),
    )


# ----------------------------------------------------------------------------------------
# phases
# ----------------------------------------------------------------------------------------
def _calibrate(
    fm: _FloatModel, recipe: Recipe, calib_file: str | None, progress: Progress
) -> tuple[CalibrationStats, list[list[int]]]:
    from edgepack.runtime_shim import Tokenizer

    if fm.tokenizer_json is None:
        raise CalibrationError(
            "calibration needs the model's tokenizer and the source has none: build from a "
            "source with one (an HF directory with tokenizer.json, or a GGUF file)"
        )
    spec = recipe.calibration
    path = calib_file or spec.file
    tok = Tokenizer.from_json(fm.tokenizer_json)
    docs = [tok.encode(d, add_special_tokens=False) for d in calibration_texts(path)]
    with_special = tok.encode("x", add_special_tokens=True)
    plain = tok.encode("x", add_special_tokens=False)
    bos = with_special[0] if len(with_special) > len(plain) else None
    samples = make_samples(docs, spec.samples, spec.min_tokens, spec.max_tokens, spec.seed, bos)
    progress.phase("calibrate", len(samples))
    stats = collect_statistics(
        fm.model,
        samples,
        seed=spec.seed,
        on_sample=lambda i, n: progress.advance(1, f"{n} tokens"),
        text_source=str(path) if path else "pydoc_data.topics keys[:40]",
    )
    return stats, samples


def _gptq_gains(
    fm: _FloatModel,
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


def _scale(
    fm: _FloatModel,
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


def _fold(fm: _FloatModel, stats: CalibrationStats, site, s: np.ndarray) -> None:
    """Record the scaling and rescale the site's statistics: ``x' = x / s``."""
    fm.transforms.fold(site, s)
    st = stats.sites[site.site]
    st.flush()
    inv = (1.0 / s).astype(np.float32)
    st.hessian *= np.outer(inv, inv)
    st.abs_sum *= inv
    st.abs_max *= inv
    st.rows = [r * inv for r in st.rows]


def _quantize(
    fm: _FloatModel,
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
        return _quantize_embedding(fm, t, choice, stats, recipe)
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


def _quantize_embedding(
    fm: _FloatModel,
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


def _write(
    out: Path,
    fm: _FloatModel,
    sens: list[TensorSensitivity],
    plan: Plan,
    encoded: dict[tuple[str, str], Any],
    sections: list[tuple[SectionKind, bytes, str, str]],
    recipe: Recipe,
    sign_keys: Sequence[object],
) -> int:
    encs = {o.choice.encoding for o in plan.choices.values()}
    if any(o.rank for o in plan.choices.values()):
        encs.add(Encoding.LOW_RANK)
    ops = required_operators(fm.identity.architecture, encs)
    provenance = Provenance(
        tool="edgepack",
        tool_version=runtime_version(),
        source_name=fm.source_name,
        source_sha256=fm.source_sha256,
        recipe={"command": "build", **recipe.to_json()},
    )
    with PackageWriter(
        out,
        fm.identity,
        min_runtime_version=runtime_version(),
        required_operators=ops,
        provenance=provenance,
    ) as w:
        for t in sens:
            opt = plan.choices[t.name]
            e = encoded[(t.name, opt.label)]
            parts = list(zip(factor_names(t.name), e, strict=True)) if opt.rank else [(t.name, e)]
            for name, part in parts:
                w.add_tensor(
                    name,
                    part.choice.encoding,
                    part.codes,
                    part.scales,
                    part.zeros,
                    shape=part.shape,
                    group_size=part.choice.group_size,
                )
            if opt.rank:
                w.add_low_rank(t.name, t.shape, factor_names(t.name), opt.rank)
        for kind, data, name, media in sections:
            w.add_section(kind, data, name=name, media_type=media)
        w.finish(sign_keys)
    return out.stat().st_size


def _plan_doc(
    sens: list[TensorSensitivity],
    plan: Plan,
    recipe: Recipe,
    predicted: dict[str, float],
    measured: dict[str, float],
    extra: dict[str, Any],
) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for t in sens:
        opt = plan.choices[t.name]
        reason = "1-D" if len(t.shape) < 2 else ("protected" if t.fixed is not None else "search")
        entry: dict[str, Any] = {"encoding": opt.label, "reason": reason, "bytes": opt.nbytes}
        if opt.rank:
            entry["rank"] = opt.rank
        if len(t.shape) >= 2:
            entry.update(
                importance=t.importance,
                predicted_error=predicted.get(t.name, 0.0),
                measured_error=measured.get(t.name, 0.0),
                proxies={k: round(v, 6) for k, v in t.proxies.items()},
                options={
                    o.label: {
                        "bytes": o.nbytes,
                        "error": o.err,
                        "cost": t.cost(o),
                        "weight_mse": o.weight_mse,
                        "proxy": o.proxy,
                    }
                    for o in t.options
                },
            )
        tensors[t.name] = entry
    return {
        "method": "search",
        "algorithm": recipe.quantize.algorithm,
        "search": {
            "method": plan.method,
            "objective": plan.objective,
            "bytes": plan.nbytes,
            "latency_ms": plan.latency_ms,
            **plan.notes,
        },
        "kv_cache": {"keys": recipe.kv_cache.keys, "values": recipe.kv_cache.values},
        **extra,
        "tensors": tensors,
    }


def _fixed_for(
    recipe: Recipe, candidates: list[EncodingChoice]
) -> Callable[[str], EncodingChoice | None]:
    uniform = candidates[0] if len(candidates) == 1 and not recipe.factorize.enabled else None

    def fixed(name: str) -> EncodingChoice | None:
        p = recipe.protected(name)
        return p if p is not None else uniform

    return fixed


def build(
    src: str | Path,
    out: str | Path,
    recipe: Recipe | None = None,
    *,
    calib_file: str | None = None,
    sign_keys: Sequence[object] = (),
    progress: Progress | None = None,
    report: bool = True,
    lut: Any = None,
) -> BuildResult:
    """Build ``out`` from ``src`` following ``recipe`` (see the module docstring)."""
    from edgepack.runtime_shim.instrument import set_blas_threads

    recipe = recipe or Recipe()
    progress = progress or Progress()
    # One BLAS thread: OpenBLAS's own threads spin and collapse on a busy machine; the
    # parallelism is the kernels' row blocks.
    set_blas_threads(1)
    src, out = Path(src), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    fm = _open_float(src)
    phases["import"] = time.perf_counter() - t0
    try:
        return _build(fm, out, recipe, calib_file, sign_keys, progress, report, lut, phases)
    finally:
        fm.close()
        pkg = getattr(fm, "_pkg", None)
        if pkg is not None:
            pkg.close()


def _build(
    fm: _FloatModel,
    out: Path,
    recipe: Recipe,
    calib_file: str | None,
    sign_keys: Sequence[object],
    progress: Progress,
    report: bool,
    lut: Any,
    phases: dict[str, float],
) -> BuildResult:
    q = recipe.quantize
    candidates = q.candidates()
    sections = _static_sections(fm)
    fixed_overhead = _fixed_overhead(fm, recipe, sections)
    _check_size_floor(fm, recipe, candidates, fixed_overhead)
    searching = len(candidates) > 1 or recipe.factorize.enabled
    needs_data = searching or q.algorithm == "gptq" or q.scale_search or q.awq or q.smoothquant
    stats: CalibrationStats | None = None
    samples: list[list[int]] = []
    if needs_data and recipe.calibration.samples > 0:
        t = time.perf_counter()
        fm.ensure_model(out.parent, progress)
        phases["float model"] = time.perf_counter() - t
        t = time.perf_counter()
        stats, samples = _calibrate(fm, recipe, calib_file, progress)
        phases["calibrate"] = time.perf_counter() - t

    # -- sensitivity
    t = time.perf_counter()
    tied = "embed.weight" if "output.weight" not in fm.names else None
    progress.phase("sensitivity", len(fm.names))
    sens = measure_sensitivity(
        fm.names,
        fm.shapes,
        fm.load,
        stats,
        candidates,
        fixed=_fixed_for(recipe, candidates),
        tied_head=tied,
        embed_search=recipe.quantize.scale_search,
        on_tensor=lambda n: progress.advance(1, n),
    )
    set_importance(sens, stats)
    if recipe.factorize.enabled and stats is not None:
        progress.phase("factorize", sum(1 for s in sens if s.layer is not None and s.fixed is None))
        add_low_rank_options(
            sens,
            fm.load,
            stats,
            recipe.factorize.ranks,
            parse_encoding(recipe.factorize.factor_encoding),
            q.damp,
            on_tensor=lambda n: progress.advance(1, n),
        )
    gains: dict[tuple[str, str], float] = {}
    if q.algorithm == "gptq" and stats is not None and searching:
        gains = _gptq_gains(fm, sens, stats, recipe, progress)
    probe_info: dict[str, Any] = {}
    probe_ids = _probe_ids(samples)
    fq = None
    if stats is not None and probe_ids:
        fq = FakeQuantModel(fm.model)
    if fq is not None and recipe.search.probe and searching:
        kinds = {s.kind for s in sens if s.fixed is None and len(s.options) > 1}
        progress.phase("probe", len(kinds) + (1 if tied else 0))
        mult, details = probe_multipliers(
            fq,
            probe_ids,
            sens,
            fm.load,
            _probe_label,
            on_kind=lambda k: progress.advance(1, k),
            quantize_embedding=lambda t, c: _quantize_embedding(fm, t, c, stats, recipe)[0],
        )
        set_importance(sens, stats, mult)
        probe_info = {"multipliers": mult, "kinds": details}
    # GPTQ's error ratios, applied after the probe: it quantizes by RTN, so its KL per
    # unit of error is calibrated on RTN errors, and a GPTQ'd option costs that rate
    # times its smaller error (scaling first inflated every kind's rate by 1/gain, up to
    # 7x for attn_k at int3). The ratios are measured on the Hessian GPTQ minimised, so
    # they overstate what reaches the output: half of the log-ratio is credited
    # (SmolLM2 plan KL on the probe / predicted: 0.3-0.8 with none, 1.4-3.3 with all)
    for s in sens:
        if s.kind != "embed":
            for o in s.options:
                o.err *= gains.get((s.kind, o.label), 1.0) ** _GAIN_CREDIT
    fm.release_model()  # its mapping would stay resident through the quantization
    calib_report = stats.report() if stats is not None else {}
    phases["sensitivity"] = time.perf_counter() - t

    # -- budgets
    target_size = _target_size(recipe, fm.params)
    overhead = fixed_overhead
    if stats is not None:
        overhead += _stored_size(json.dumps(calib_report, sort_keys=True).encode()) + 64
    # the precision plan, sized from a provisional plan (its numbers change, not its shape)
    first = Plan({s.name: s.options[0] for s in sens}, 0, 0.0, None, "provisional")
    doc = _plan_doc(sens, first, recipe, {}, {}, {"probe": probe_info})
    overhead += int(_stored_size(json.dumps(doc, sort_keys=True).encode()) * 1.3) + 1024
    overhead += 512 * len(sign_keys)
    latency_fn, latency_budget, base_latency = _latency(recipe, lut, fm)
    if target_size:
        budget = target_size - overhead
    else:
        budget = sum(max(o.nbytes for o in s.options) for s in sens)

    encoded: dict[tuple[str, str], Any] = {}
    measured: dict[str, float] = {}
    predicted: dict[str, float] = {}
    scaling: dict[str, Any] = {}
    t_search = t_scale = t_quant = t_write = 0.0
    size = 0
    plan: Plan | None = None
    for attempt in range(_SIZE_ITERATIONS):
        t = time.perf_counter()
        progress.phase("search", 1)
        try:
            plan = search(sens, budget, recipe.search.method, latency_fn, latency_budget)
        except SearchError as exc:
            what = f"target {target_size:,} bytes for the whole file" if target_size else ""
            raise SearchError(f"{exc} ({what})" if what else str(exc)) from None
        progress.advance(1, plan.method)
        t_search += time.perf_counter() - t
        if attempt == 0 and stats is not None and (q.awq or q.smoothquant):
            t = time.perf_counter()
            scaling = _scale(fm, plan, stats, recipe, progress)
            t_scale += time.perf_counter() - t
        t = time.perf_counter()
        todo = [s for s in sens if (s.name, plan.choices[s.name].label) not in encoded]
        progress.phase("quantize", len(todo))
        for s in todo:
            opt = plan.choices[s.name]
            e, err = _quantize(fm, s, opt, stats, recipe)
            encoded[(s.name, opt.label)] = e
            measured[s.name] = err
            progress.advance(1, f"{s.name} {opt.label}")
        for s in sens:
            predicted[s.name] = s.cost(plan.choices[s.name])
        t_quant += time.perf_counter() - t
        t = time.perf_counter()
        progress.phase("write", 1)
        extra = {
            "gptq_gain": {f"{k}/{lbl}": v for (k, lbl), v in gains.items()},
            "probe": probe_info,
            "scaling": scaling,
        }
        doc = _plan_doc(sens, plan, recipe, predicted, measured, extra)
        secs = [
            *sections,
            (
                SectionKind.PRECISION_PLAN,
                json.dumps(doc, sort_keys=True).encode(),
                "plan",
                "application/json",
            ),
        ]
        if stats is not None:
            secs.append(
                (
                    SectionKind.CALIBRATION_REPORT,
                    json.dumps(calib_report, sort_keys=True).encode(),
                    "calibration",
                    "application/json",
                )
            )
        size = _write(out, fm, sens, plan, encoded, secs, recipe, sign_keys)
        progress.advance(1, out.name)
        t_write += time.perf_counter() - t
        if not target_size or size <= target_size:
            break
        budget -= size - target_size + 4096
    assert plan is not None
    phases["search"] = t_search
    if t_scale:
        phases["scale"] = t_scale
    phases["quantize"] = t_quant
    phases["write"] = t_write
    if target_size and size > target_size:
        raise SearchError(f"could not fit {target_size:,} bytes (got {size:,})")
    if latency_fn is not None and plan.latency_ms is not None:
        plan.latency_ms += base_latency

    result = BuildResult(
        path=out,
        nbytes=size,
        params=fm.params,
        plan=plan,
        phases=phases,
        peak_rss=0,
        target_size=target_size,
        sensitivities=sens,
        measured=measured,
        predicted=predicted,
        calibration=calib_report,
        probe=probe_info,
        scaling=scaling,
    )
    if fq is not None and searching:  # the whole plan on the probe tokens
        t = time.perf_counter()
        progress.phase("verify", 1)
        if stats is not None:
            stats.sites.clear()  # the Hessians are done with
        fm.ensure_model(out.parent, progress)
        fq = FakeQuantModel(fm.model)
        result.measured_kl = _plan_kl(fm, fq, probe_ids, sens, plan, encoded)
        result.predicted_kl = plan.objective if probe_info else None
        progress.advance(1)
        phases["verify"] = time.perf_counter() - t
    result.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if report:
        from .report import write_report

        t = time.perf_counter()
        result.report_path, result.plot_path = write_report(result, recipe)
        phases["report"] = time.perf_counter() - t
    return result


def _plan_kl(
    fm: _FloatModel,
    fq: FakeQuantModel,
    probe_ids: list[list[int]],
    sens: list[TensorSensitivity],
    plan: Plan,
    encoded: dict[tuple[str, str], Any],
) -> float:
    chosen: dict[str, Any] = {}
    for s in sens:
        e = encoded[(s.name, plan.choices[s.name].label)]
        if len(s.shape) >= 2:
            chosen[s.name] = e
        elif s.name in fm.transforms.vecs:  # norms / biases rescaled by AWQ, SmoothQuant
            chosen[s.name] = fm.load(s.name)
    return measure_plan_kl(fq, probe_ids, chosen)


def _probe_ids(samples: list[list[int]], tokens: int = _PROBE_TOKENS) -> list[list[int]]:
    """The longest calibration samples, up to ``tokens`` tokens in all."""
    out: list[list[int]] = []
    n = 0
    for s in sorted(samples, key=len, reverse=True):
        if n >= tokens:
            break
        out.append(s[: tokens - n])
        n += len(out[-1])
    return out


def _probe_label(t: TensorSensitivity) -> str | None:
    """The probe quantizes with a low-bit option, where errors are well above noise."""
    prefs = ("int3-g32-s8", "int3-g32", "int3-g64", "int3-g32-asym", "int2-g32-asym", "int4-g32")
    for pref in prefs:
        if any(o.label == pref for o in t.options):
            return pref
    opts = sorted((o for o in t.options if not o.rank), key=lambda o: o.nbytes)
    return opts[0].label if opts else None


def _fixed_overhead(fm: _FloatModel, recipe: Recipe, sections: list) -> int:
    """File bytes besides tensors that are known before calibration: preamble and header
    (rounded up to the page the data region starts on) and the static sections."""
    header = 2048 + sum(len(n) + _HEADER_PER_TENSOR for n in fm.names)
    header += len(json.dumps(recipe.to_json())) + len(json.dumps(fm.identity.config, default=str))
    overhead = -(-(128 + header) // 4096) * 4096
    return overhead + sum(_stored_size(d) + 64 for _, d, _, _ in sections)


def _check_size_floor(
    fm: _FloatModel, recipe: Recipe, candidates: list[EncodingChoice], overhead: int
) -> None:
    """Refuse a size budget that even the smallest candidates overshoot before the
    minutes of calibration (the search would find it out only afterwards): tensor bytes
    plus the overhead known so far, a lower bound; the search still checks the file."""
    target = _target_size(recipe, fm.params)
    if not target or recipe.factorize.enabled:  # low-rank options can go below any encoding
        return
    fixed = _fixed_for(recipe, candidates)
    floor = overhead
    for name, shape in zip(fm.names, fm.shapes, strict=True):
        if len(shape) < 2:
            floor += padded_bytes(EncodingChoice(Encoding.F32), shape)
            continue
        cols = math.prod(shape[1:])
        pinned = fixed(name)
        options = [pinned] if pinned is not None else candidates
        fits = [c for c in options if fit_group(c, cols) is not None]
        fits = fits or [EncodingChoice(Encoding.INT8_CHANNEL)]  # measure_sensitivity's fallback
        floor += min(padded_bytes(c, shape) for c in fits)
    if floor > target:
        raise SearchError(
            f"target {target:,} bytes for the whole file is below the smallest possible: "
            f"{floor:,} bytes with every tensor at its smallest candidate "
            f"({', '.join(c.label for c in candidates)}) or protected encoding; allow "
            "smaller encodings (e.g. int2-asym, group size 64) or raise the budget"
        )


def _target_size(recipe: Recipe, params: int) -> int | None:
    s = recipe.search
    if s.target_size:
        return int(s.target_size)
    if s.target_bpw:
        return int(s.target_bpw * params / 8)
    return None


def _static_sections(fm: _FloatModel) -> list[tuple[SectionKind, bytes, str, str]]:
    """Sections copied from the source."""
    out = []
    if fm.tokenizer_json:
        out.append(
            (
                SectionKind.TOKENIZER,
                fm.tokenizer_json.encode(),
                "tokenizer.json",
                "application/json",
            )
        )
    if fm.chat_template:
        out.append(
            (SectionKind.CHAT_TEMPLATE, fm.chat_template.encode(), "default", "text/x-jinja2")
        )
    if fm.model_config:
        out.append((SectionKind.MODEL_CONFIG, fm.model_config, "source", "application/json"))
    return out


def _stored_size(data: bytes) -> int:
    """Bytes a section takes in the file (the writer zstd-compresses when it helps)."""
    import zstandard

    if len(data) < 1024:
        return len(data)
    return min(len(data), len(zstandard.ZstdCompressor(level=19).compress(data)))


def _latency(recipe: Recipe, lut: Any, fm: _FloatModel):
    """(per-option latency function, budget for the matmuls, fixed part), or Nones."""
    s = recipe.search
    if lut is None and s.lut:
        from .profile_device import LatencyTable

        lut = LatencyTable.load(s.lut)
    if lut is None:
        return None, None, 0.0
    from .profile_device import model_overhead_ms

    base = model_overhead_ms(lut, fm.identity.config)
    head = "output.weight" if "output.weight" in fm.names else "embed.weight"

    def fn(t: TensorSensitivity, o: Option) -> float:
        if len(t.shape) < 2 or (t.layer is None and t.name != head):
            return 0.0
        return lut.predict(t.shape, o)

    budget = s.latency_budget_ms - base if s.latency_budget_ms else None
    return fn, budget, base
