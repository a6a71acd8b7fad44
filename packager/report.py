"""The build report: ``OUT.report.md`` and ``OUT.report.png`` next to the package.

The Markdown holds the summary (size, bits per weight, encodings, search objective,
timings, memory), the calibration figures, the per-kind probe multipliers and one row per
tensor (choice, bits, importance, predicted and measured error, proxies). The PNG (when
matplotlib is installed) plots, along the model's tensors: bits per weight chosen,
the sensitivity (cost of the cheapest candidate over the chosen one's), and predicted vs
measured error.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from edgepack.format.output_file import create_scratch_dir

from .recipe import Recipe

if TYPE_CHECKING:
    from .build import BuildResult

__all__ = ["write_report"]


def _bits(nbytes: int, numel: int) -> float:
    return 8 * nbytes / numel if numel else 0.0


def write_report(result: BuildResult, recipe: Recipe) -> tuple[Path, Path | None]:
    md = result.path.with_suffix(".report.md")  # OUT.epk -> OUT.report.md, OUT.report.png
    png = result.path.with_suffix(".report.png")
    # written in a scratch directory beside the package, then renamed into place: a killed
    # build leaves no torn report under its name (the next build clears the directory)
    scratch = create_scratch_dir(result.path)
    try:
        plot = _plot(result, scratch / png.name)
        (scratch / md.name).write_text(_markdown(result, recipe, plot and png))
        if plot is not None:
            os.replace(plot, png)
            plot = png
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
    if r.fallbacks:
        lines += ["## Group-size fallbacks", ""]
        lines += [f"- `{name}`: {why}" for name, why in r.fallbacks.items()] + [""]
    if plot is not None:
        lines += [f"![per-tensor plan]({plot.name})", ""]
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


def _plot(r: BuildResult, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [t for t in r.sensitivities if len(t.shape) >= 2]
    if not rows:
        return None
    x = list(range(len(rows)))
    bits = [_bits(r.plan.choices[t.name].nbytes, t.numel) for t in rows]
    sens = []
    for t in rows:
        worst = max(t.cost(o) for o in t.options)
        sens.append(max(worst, 1e-12))
    pred = [max(r.predicted.get(t.name, 0.0), 1e-12) for t in rows]
    meas = [max(r.measured.get(t.name, 0.0), 1e-12) for t in rows]
    fig, axes = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    axes[0].bar(x, bits, color="tab:blue")
    axes[0].set_ylabel("bits / weight")
    axes[0].set_title(f"{r.path.name}: {r.bpw:.2f} bpw, {r.nbytes / 1e6:.2f} MB")
    axes[1].semilogy(x, sens, ".", color="tab:red")
    axes[1].set_ylabel("sensitivity\n(cost, cheapest option)")
    axes[2].semilogy(x, pred, ".", label="predicted", color="tab:orange")
    axes[2].semilogy(x, meas, "x", label="measured", color="tab:green", markersize=4)
    axes[2].set_ylabel("error (objective units)")
    axes[2].legend()
    ticks = [i for i, t in enumerate(rows) if t.kind in ("attn_q", "embed", "output")]
    axes[2].set_xticks(ticks)
    axes[2].set_xticklabels(
        [rows[i].name.replace(".weight", "") for i in ticks], rotation=90, fontsize=6
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
