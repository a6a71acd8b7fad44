"""The build report: ``OUT.report.md``, ``OUT.report.json`` and ``OUT.report.png``
next to the package.

The Markdown holds the summary (size, bits per weight, encodings, search objective,
held-out quality with ``--eval``, timings, memory), the calibration figures, the
per-kind probe multipliers and one row per tensor (choice, bits, importance, predicted
and measured error, proxies). The JSON holds ``BuildResult.to_json()`` and the plot's
series; the PNG (when matplotlib is installed) is drawn by :mod:`.build.report_plot`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from edgepack.format.output_file import create_scratch_dir

from .build.report_plot import draw_plot, plot_series
from .recipe import Recipe

if TYPE_CHECKING:
    from .build import BuildResult

__all__ = ["write_report"]


def _bits(nbytes: int, numel: int) -> float:
    return 8 * nbytes / numel if numel else 0.0


def write_report(result: BuildResult, recipe: Recipe) -> tuple[Path, Path | None]:
    md = result.path.with_suffix(".report.md")  # OUT.epk -> OUT.report.md, .png, .json
    png = result.path.with_suffix(".report.png")
    report_json = result.path.with_suffix(".report.json")
    series = plot_series(result, recipe)
    # written in a scratch directory beside the package, then renamed into place: a killed
    # build leaves no torn report under its name (the next build clears the directory)
    scratch = create_scratch_dir(result.path)
    try:
        plot = draw_plot(series, scratch / png.name)
        (scratch / md.name).write_text(_markdown(result, recipe, plot and png))
        doc = {**result.to_json(), "report": str(md), "plot": str(png) if plot else None}
        doc["plot_data"] = series.to_json()
        (scratch / report_json.name).write_text(json.dumps(doc, indent=2) + "\n")
        if plot is not None:
            os.replace(plot, png)
            plot = png
        os.replace(scratch / report_json.name, report_json)
        os.replace(scratch / md.name, md)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return md, plot


def _markdown(r: BuildResult, recipe: Recipe, plot: Path | None) -> str:
    lines = [f"# Build report: {r.path.name}", ""]
    lines += ["```", *r.summary(), "```", ""]
    q = recipe.quantize
    lines += [
        "## Recipe",
        "",
        f"- algorithm **{q.algorithm}** (act-order {q.act_order}, damp {q.damp}, "
        f"block {q.block_size}, scale search {q.scale_search})",
        f"- candidates: {', '.join(c.label for c in q.candidates())}",
        f"- protected: {dict(recipe.protect) or 'none'}",
        f"- search: {r.plan.method}, target "
        + (f"{r.target_size:,} bytes" if r.target_size else "none"),
        f"- KV cache policy: keys {recipe.kv_cache.keys}, values {recipe.kv_cache.values}",
        "",
    ]
    c = r.calibration
    if c:
        lines += [
            "## Calibration",
            "",
            f"{c['samples']} samples, {c['tokens']} tokens (length {c['length_min']} .. "
            f"{c['length_max']}, median {c['length_median']:.0f}) from {c['source']}, "
            f"{r.phases.get('calibrate', 0.0):.1f} s.",
            "",
        ]
    if r.probe:
        lines += ["## Probe (KL per tensor kind, quantized alone)", ""]
        lines += ["| kind | predicted | measured KL | multiplier |", "|---|---|---|---|"]
        for kind, d in sorted(r.probe.get("kinds", {}).items()):
            lines.append(
                f"| {kind} | {d['predicted']:.4g} | {d['measured_kl']:.4g} | "
                f"{d['multiplier']:.3g} |"
            )
        lines.append("")
    if r.evaluation is not None:
        e = r.evaluation
        lines += [
            "## Held-out quality (against the float model)",
            "",
            f"{Path(r.eval_file or '').name}: {e.tokens} tokens in {e.chunks} chunks of {e.ctx}",
            "",
            "| | PPL | mean KL | top-1 agreement |",
            "|---|---|---|---|",
            f"| float | {e.ref_ppl:.4f} | | |",
            f"| package | {e.ppl:.4f} +/- {e.ppl_stderr:.4f} | {e.kl_mean:.5f} +/- "
            f"{e.kl_stderr:.5f} | {100 * (e.top1 or 0.0):.2f} % |",
            "",
        ]
    if r.fallbacks:
        lines += ["## Group-size fallbacks", ""]
        lines += [f"- `{name}`: {why}" for name, why in r.fallbacks.items()] + [""]
    if plot is not None:
        lines += [f"![size against quality, bits per layer]({plot.name})", ""]
    lines += [
        "## Tensors",
        "",
        "| tensor | encoding | bits | importance | predicted | measured | outliers | kurtosis |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in r.sensitivities:
        if len(t.shape) < 2:
            continue
        o = r.plan.choices[t.name]
        lines.append(
            f"| {t.name} | {o.label} | {_bits(o.nbytes, t.numel):.2f} | {t.importance:.3g} | "
            f"{r.predicted.get(t.name, 0):.3g} | {r.measured.get(t.name, 0):.3g} | "
            f"{t.proxies.get('outlier_ratio', 0):.1f} | {t.proxies.get('kurtosis', 0):.1f} |"
        )
    lines.append("")
    return "\n".join(lines)
