"""The build's phases in order (see the package docstring); each phase is a function of
its own module, this one only sequences them and keeps the timings."""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edgepack.format import SectionKind

from ..calibration import CalibrationStats
from ..convert import check_release_fields, resolve_model_name
from ..encode import parse_encoding
from ..errors import InputError
from ..factorize import add_low_rank_options
from ..model_card import Fields, merge_card
from ..prefix import PrefixCacheInfo, PrefixRequest, recipe_prefixes, write_with_prefixes
from ..recipe import Recipe
from ..search import Plan, SearchError, search
from ..sensitivity import (
    FakeQuantModel,
    TensorSensitivity,
    measure_sensitivity,
    probe_multipliers,
    set_importance,
)
from .budget import (
    check_size_floor,
    fixed_for,
    fixed_overhead,
    group_fallbacks,
    latency_model,
    size_target,
    stored_size,
)
from .calibrate import calibrate, probe_ids
from .evaluate import check_eval_text, check_held_out, evaluate_build
from .measure import gptq_gains, probe_label
from .plan_doc import plan_doc
from .quantize import quantize, quantize_embedding
from .result import BuildResult, Progress
from .scale import scale_weights
from .source import FloatModel, open_float, remove_stale_scratch, static_sections
from .verify import plan_kl
from .write import PackageContent, package_size, write_package

__all__ = ["BuildOutputError", "build"]

_SIZE_ITERATIONS = 4
_GAIN_CREDIT = 0.5  # exponent of the GPTQ error ratio credited to GPTQ'd options


class BuildOutputError(InputError):
    """The output path is the source: a build never overwrites its input."""


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
    model_name: str | None = None,
    model_version: str = "1.0.0",
    min_runtime_version: str | None = None,
    prefixes: PrefixRequest | None = None,
    eval_file: str | Path | None = None,
    card: Fields | None = None,
    adapters: Sequence[str | Path] = (),
) -> BuildResult:
    """Build ``out`` from ``src`` following ``recipe`` (see the package docstring).
    ``model_name`` defaults to the source's (made valid); the version fields are checked
    before the source is read. ``eval_file`` (default: the recipe's ``[eval] file``):
    held-out text the written package is scored on against the float model. ``card``:
    model-card fields the user gave, over the source's (:mod:`..model_card`).
    ``prefixes`` (default: the recipe's ``[[prefixes]]``): prefixes stored as KV caches.
    ``adapters``: PEFT folders packed as LORA_ADAPTER sections bound to the built weights."""
    from edgepack.runtime_shim.instrument import set_blas_threads

    check_release_fields(model_version, min_runtime_version)
    given_name = resolve_model_name(model_name, "") if model_name is not None else None
    recipe = recipe or Recipe()
    if prefixes is None:  # given prefixes (--prefix-file) win over the recipe's
        prefixes = recipe_prefixes(recipe.prefixes)
    progress = progress or Progress()
    held_out = eval_file or recipe.evaluation.file
    held_out = check_held_out(held_out, calib_file or recipe.calibration.file) if held_out else None
    # One BLAS thread: OpenBLAS's own threads spin and collapse on a busy machine; the
    # parallelism is the kernels' row blocks.
    set_blas_threads(1)
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise BuildOutputError(f"{out} is the source: give the build another output path")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_scratch(out)  # what a killed build of this output left
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    fm = open_float(src)
    phases["import"] = time.perf_counter() - t0
    name = given_name or resolve_model_name(None, fm.identity.name)
    fm.identity = replace(fm.identity, name=name, version=model_version)
    fm.card = merge_card(fm.card, dict(card or {}))
    release: dict[str, Any] = {"min_runtime_version": min_runtime_version}
    if adapters:
        from ..adapters import build_adapter_sources

        release["adapters"] = build_adapter_sources(adapters)
    try:
        if held_out is not None:  # before the minutes of building
            check_eval_text(fm, held_out, recipe)
        return _build(
            fm, out, recipe, calib_file, sign_keys, progress, report, lut, phases, release,
            prefixes,
            held_out,
        )
    finally:
        fm.close()
        pkg = getattr(fm, "_pkg", None)
        if pkg is not None:
            pkg.close()


@dataclass
class _Measured:
    """What the sensitivity phase hands to the search."""

    sens: list[TensorSensitivity]
    gains: dict[tuple[str, str], float] = field(default_factory=dict)
    probe_info: dict[str, Any] = field(default_factory=dict)
    probe_ids: list[list[int]] = field(default_factory=list)
    fq: FakeQuantModel | None = None


def _build(
    fm: FloatModel,
    out: Path,
    recipe: Recipe,
    calib_file: str | None,
    sign_keys: Sequence[object],
    progress: Progress,
    report: bool,
    lut: Any,
    phases: dict[str, float],
    release: dict[str, Any],
    prefixes: PrefixRequest | None = None,
    held_out: Path | None = None,
) -> BuildResult:
    q = recipe.quantize
    candidates = q.candidates()
    sections = static_sections(fm)
    overhead = fixed_overhead(fm, recipe, sections)
    check_size_floor(fm, recipe, candidates, overhead)
    searching = len(candidates) > 1 or recipe.factorize.enabled
    needs_data = searching or q.algorithm == "gptq" or q.scale_search or q.awq or q.smoothquant
    calibrating = needs_data and recipe.calibration.samples > 0
    _announce_phases(progress, recipe, calibrating, searching)
    stats: CalibrationStats | None = None
    samples: list[list[int]] = []
    if calibrating:
        t = time.perf_counter()
        fm.ensure_model(out, progress)
        phases["float model"] = time.perf_counter() - t
        t = time.perf_counter()
        stats, samples = calibrate(fm, recipe, calib_file, progress)
        phases["calibrate"] = time.perf_counter() - t

    t = time.perf_counter()
    m = _sensitivity(fm, recipe, stats, samples, searching, progress)
    fm.release_model()  # its mapping would stay resident through the quantization
    calib_report = stats.report() if stats is not None else {}
    phases["sensitivity"] = time.perf_counter() - t

    target_size = size_target(recipe, fm.params)
    calib = calib_report if stats is not None else None
    budget = _budget(fm, recipe, m, target_size, overhead, calib, len(sign_keys))
    latency_fn, latency_budget, base_latency = latency_model(recipe, lut, fm)

    # -- search, scale, quantize until the exact file size meets the target
    encoded: dict[tuple[str, str], Any] = {}
    measured: dict[str, float] = {}
    predicted: dict[str, float] = {}
    scaling: dict[str, Any] = {}
    t_search = t_scale = t_quant = 0.0
    size = data_offset = 0
    plan: Plan | None = None
    content: PackageContent | None = None
    for attempt in range(_SIZE_ITERATIONS):
        t = time.perf_counter()
        progress.phase("search", 1)
        try:
            plan = search(m.sens, budget, recipe.search.method, latency_fn, latency_budget)
        except SearchError as exc:
            what = f"target {target_size:,} bytes for the whole file" if target_size else ""
            raise SearchError(f"{exc} ({what})" if what else str(exc)) from None
        progress.advance(1, plan.method)
        t_search += time.perf_counter() - t
        if attempt == 0 and stats is not None and (q.awq or q.smoothquant):
            t = time.perf_counter()
            scaling = scale_weights(fm, plan, stats, recipe, progress)
            t_scale += time.perf_counter() - t
        t = time.perf_counter()
        _quantize_plan(fm, m.sens, plan, stats, recipe, encoded, measured, progress)
        for s in m.sens:
            predicted[s.name] = s.cost(plan.choices[s.name])
        t_quant += time.perf_counter() - t
        extra = {
            "gptq_gain": {f"{k}/{lbl}": v for (k, lbl), v in m.gains.items()},
            "probe": m.probe_info,
            "scaling": scaling,
        }
        doc = plan_doc(m.sens, plan, recipe, predicted, measured, extra)
        secs = [*sections, _json_section(SectionKind.PRECISION_PLAN, doc, "plan")]
        if stats is not None:
            secs.append(_json_section(SectionKind.CALIBRATION_REPORT, calib_report, "calibration"))
        content = PackageContent(fm, m.sens, plan, encoded, secs, recipe, **release)
        size, data_offset = package_size(content, sign_keys)
        if not target_size or size <= target_size:
            break
        budget -= size - target_size + 4096
    assert plan is not None and content is not None
    phases["search"] = t_search
    if t_scale:
        phases["scale"] = t_scale
    phases["quantize"] = t_quant
    if target_size and size > target_size:
        raise SearchError(f"could not fit {target_size:,} bytes (got {size:,})")

    t = time.perf_counter()
    progress.phase("write", 1)
    caches: list[PrefixCacheInfo] = []
    if prefixes is None:
        written = write_package(out, content, sign_keys, data_offset)
        assert written == size, f"{out}: wrote {written:,} bytes, laid out {size:,}"
    else:  # caches are computed on the written package; the final one is signed once
        def plain(path: Path) -> int:
            return write_package(path, content, (), data_offset)

        _, caches = write_with_prefixes(out, plain, prefixes, sign_keys)
        size = out.stat().st_size
    progress.advance(1, out.name)
    phases["write"] = time.perf_counter() - t
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
        sensitivities=m.sens,
        measured=measured,
        predicted=predicted,
        calibration=calib_report,
        probe=m.probe_info,
        scaling=scaling,
        fallbacks=group_fallbacks(fm, recipe, candidates),
        prefix_caches=caches,
    )
    if m.fq is not None and searching:  # the whole plan on the probe tokens
        t = time.perf_counter()
        progress.phase("verify", 1)
        if stats is not None:
            stats.sites.clear()  # the Hessians are done with
        fm.ensure_model(out, progress)
        m.fq = FakeQuantModel(fm.model)  # the first one wraps the released model: drop it
        result.measured_kl = plan_kl(fm, m.fq, m.probe_ids, m.sens, plan, encoded)
        result.predicted_kl = plan.objective if m.probe_info else None
        progress.advance(1)
        phases["verify"] = time.perf_counter() - t
    if held_out is not None:
        t = time.perf_counter()
        result.evaluation = evaluate_build(fm, out, recipe, held_out, progress)
        result.eval_file = str(held_out)
        phases["evaluate"] = time.perf_counter() - t
    result.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if report:
        from ..report import write_report

        t = time.perf_counter()
        result.report_path, result.plot_path = write_report(result, recipe)
        phases["report"] = time.perf_counter() - t
    return result


def _announce_phases(
    progress: Progress, recipe: Recipe, calibrating: bool, searching: bool
) -> None:
    """Tell ``progress`` the phases :func:`_build` will run, in order (the CLI shows
    "phase 3/9" and a total ETA); a progress object without ``plan`` is not told."""
    plan = getattr(progress, "plan", None)
    if plan is None:
        return
    q = recipe.quantize
    steps = [
        ("float model", calibrating),
        ("calibrate", calibrating),
        ("sensitivity", True),
        ("factorize", calibrating and recipe.factorize.enabled),
        ("gptq gain", calibrating and searching and q.algorithm == "gptq"),
        ("probe", calibrating and searching and recipe.search.probe),
        ("search", True),
        ("scale", calibrating and (q.awq or q.smoothquant)),
        ("quantize", True),
        ("write", True),
        ("verify", calibrating and searching),
    ]
    plan([name for name, runs in steps if runs])


def _sensitivity(
    fm: FloatModel,
    recipe: Recipe,
    stats: CalibrationStats | None,
    samples: list[list[int]],
    searching: bool,
    progress: Progress,
) -> _Measured:
    """Every tensor's sensitivity to every candidate; low-rank options; GPTQ's gains;
    the probe's per-kind multipliers."""
    q = recipe.quantize
    candidates = q.candidates()
    tied = "embed.weight" if "output.weight" not in fm.names else None
    progress.phase("sensitivity", len(fm.names))
    sens = measure_sensitivity(
        fm.names,
        fm.shapes,
        fm.load,
        stats,
        candidates,
        fixed=fixed_for(recipe, candidates),
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
    m = _Measured(sens)
    if q.algorithm == "gptq" and stats is not None and searching:
        m.gains = gptq_gains(fm, sens, stats, recipe, progress)
    m.probe_ids = probe_ids(samples)
    if stats is not None and m.probe_ids:
        m.fq = FakeQuantModel(fm.model)
    if m.fq is not None and recipe.search.probe and searching:
        kinds = {s.kind for s in sens if s.fixed is None and len(s.options) > 1}
        progress.phase("probe", len(kinds) + (1 if tied else 0))
        mult, details = probe_multipliers(
            m.fq,
            m.probe_ids,
            sens,
            fm.load,
            probe_label,
            on_kind=lambda k: progress.advance(1, k),
            quantize_embedding=lambda t, c: quantize_embedding(fm, t, c, stats, recipe)[0],
        )
        set_importance(sens, stats, mult)
        m.probe_info = {"multipliers": mult, "kinds": details}
    # GPTQ's error ratios, applied after the probe: it quantizes by RTN, so its KL per
    # unit of error is calibrated on RTN errors, and a GPTQ'd option costs that rate
    # times its smaller error (scaling first inflated every kind's rate by 1/gain, up to
    # 7x for attn_k at int3). The ratios are measured on the Hessian GPTQ minimised, so
    # they overstate what reaches the output: half of the log-ratio is credited
    # (SmolLM2 plan KL on the probe / predicted: 0.3-0.8 with none, 1.4-3.3 with all)
    for s in sens:
        if s.kind != "embed":
            for o in s.options:
                o.err *= m.gains.get((s.kind, o.label), 1.0) ** _GAIN_CREDIT
    return m


def _budget(
    fm: FloatModel,
    recipe: Recipe,
    m: _Measured,
    target_size: int | None,
    overhead: int,
    calib_report: dict[str, Any] | None,
    n_keys: int,
) -> int:
    """Bytes the search may give the tensors: the target less an estimate of the rest
    (the exact file size is checked before writing, and the budget tightened if short)."""
    if not target_size:
        return sum(max(o.nbytes for o in s.options) for s in m.sens)
    if calib_report is not None:
        overhead += stored_size(json.dumps(calib_report, sort_keys=True).encode()) + 64
    # the precision plan, sized from a provisional plan (its numbers change, not its shape)
    first = Plan({s.name: s.options[0] for s in m.sens}, 0, 0.0, None, "provisional")
    doc = plan_doc(m.sens, first, recipe, {}, {}, {"probe": m.probe_info})
    overhead += int(stored_size(json.dumps(doc, sort_keys=True).encode()) * 1.3) + 1024
    overhead += 512 * n_keys
    return target_size - overhead


def _quantize_plan(
    fm: FloatModel,
    sens: list[TensorSensitivity],
    plan: Plan,
    stats: CalibrationStats | None,
    recipe: Recipe,
    encoded: dict[tuple[str, str], Any],
    measured: dict[str, float],
    progress: Progress,
) -> None:
    """Encode the tensors whose chosen option is not encoded yet (a tightened budget
    redoes only the tensors whose choice changed)."""
    todo = [s for s in sens if (s.name, plan.choices[s.name].label) not in encoded]
    progress.phase("quantize", len(todo))
    for s in todo:
        opt = plan.choices[s.name]
        e, err = quantize(fm, s, opt, stats, recipe)
        encoded[(s.name, opt.label)] = e
        measured[s.name] = err
        progress.advance(1, f"{s.name} {opt.label}")


def _json_section(kind: SectionKind, doc: dict[str, Any], name: str) -> tuple:
    return (kind, json.dumps(doc, sort_keys=True).encode(), name, "application/json")
