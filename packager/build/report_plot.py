"""The build report's plot, ``OUT.report.png``: what a release engineer decides on.

1. **Size against quality** of candidate plans: the search (the recipe's method, on the
   same sensitivities) run at budgets across the whole feasible range, and the uniform
   plans (every searched tensor at one candidate encoding); the chosen plan is marked
   and labelled, the size target drawn as a line. Quality is the search's objective
   (importance-weighted predicted error; KL units once the probe calibrated it); the
   chosen plan also shows its measured KL (probe tokens) and held-out KL (``--eval``).
2. **Bits per layer** (or tensor group: embed, output) of the weight matrices, stacked by
   encoding (the bits each encoding contributes per weight of the layer), with a legend,
   the target bits per weight and the file's achieved one (both whole-file figures;
   the 1-D norms, always f32 and a negligible share, are left out of the bars).
3. **Predicted vs measured error** per tensor (the error model behind the search).

:func:`plot_series` returns the data every panel is drawn from (also stored in
``OUT.report.json``); :func:`draw_plot` draws it with matplotlib's Agg backend.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import SearchError
from ..recipe import Recipe
from ..search import Plan, search
from ..sensitivity import TensorSensitivity

if TYPE_CHECKING:
    from .result import BuildResult

__all__ = ["LayerBar", "PlanPoint", "PlotSeries", "draw_plot", "plot_series"]

_SWEEP = 9  # budgets the search is re-run at, across the feasible range


@dataclass(frozen=True)
class PlanPoint:
    """One plan on the size/quality panel."""

    label: str
    kind: str  # "chosen" | "search" (another budget) | "uniform" (one encoding)
    file_bytes: int  # tensor bytes plus the chosen package's other bytes
    objective: float  # importance-weighted predicted error (the search's objective)
    measured_kl: float | None = None  # the chosen plan's KL on the probe tokens
    eval_kl: float | None = None  # the chosen plan's mean KL on held-out text


@dataclass(frozen=True)
class LayerBar:
    """Bits per weight of one layer (or tensor group), split by encoding."""

    group: str
    params: int
    bits: dict[str, float]  # encoding label -> bits it contributes per weight of the group


@dataclass
class PlotSeries:
    title: str
    chosen: PlanPoint
    candidates: list[PlanPoint]
    target_size: int | None
    target_bpw: float | None
    bpw: float  # the written file's bits per weight
    layers: list[LayerBar]
    tensors: list[str] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    measured: list[float] = field(default_factory=list)

    @property
    def encodings(self) -> list[str]:
        """Every encoding on the bars, in first-seen order."""
        seen: dict[str, None] = {}
        for bar in self.layers:
            for label in bar.bits:
                seen.setdefault(label, None)
        return list(seen)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "encodings": self.encodings}


def _point(plan: Plan, label: str, kind: str, overhead: int) -> PlanPoint:
    return PlanPoint(label, kind, plan.nbytes + overhead, plan.objective)


def _candidates(
    sens: list[TensorSensitivity], method: str, overhead: int
) -> list[PlanPoint]:
    """The search at budgets spread from the smallest to the largest plan, and the
    uniform plans (searched tensors at one encoding, where their shape allows it)."""
    lo = sum(min(o.nbytes for o in s.options) for s in sens)
    hi = sum(max(o.nbytes for o in s.options) for s in sens)
    out: list[PlanPoint] = []
    seen: set[int] = set()
    for i in range(_SWEEP):
        budget = lo + (hi - lo) * i // (_SWEEP - 1)
        try:
            plan = search(sens, budget, method)
        except SearchError:
            continue
        if plan.nbytes not in seen:
            seen.add(plan.nbytes)
            out.append(_point(plan, f"{method} @ {budget / 1e6:.1f} MB", "search", overhead))
    labels = {o.label for s in sens if s.fixed is None for o in s.options if not o.rank}
    for label in sorted(labels):
        choices = {}
        for s in sens:
            match = [o for o in s.options if o.label == label]
            choices[s.name] = match[0] if match and s.fixed is None else s.options[0]
        nbytes = sum(o.nbytes for o in choices.values())
        objective = sum(s.cost(choices[s.name]) for s in sens)
        out.append(PlanPoint(f"all {label}", "uniform", nbytes + overhead, objective))
    return out


def _group(s: TensorSensitivity) -> str:
    return f"{s.layer}" if s.layer is not None else s.kind


def _layers(r: BuildResult) -> list[LayerBar]:
    params: dict[str, int] = {}
    nbytes: dict[str, dict[str, int]] = {}
    for s in r.sensitivities:
        if len(s.shape) < 2:
            continue
        g = _group(s)
        opt = r.plan.choices[s.name]
        params[g] = params.get(g, 0) + s.numel
        by_label = nbytes.setdefault(g, {})
        by_label[opt.label] = by_label.get(opt.label, 0) + opt.nbytes
    return [
        LayerBar(g, params[g], {lbl: 8 * b / params[g] for lbl, b in nbytes[g].items()})
        for g in nbytes
        if params[g]
    ]


def plot_series(r: BuildResult, recipe: Recipe) -> PlotSeries:
    """Every series the report plot draws (see the module docstring)."""
    overhead = r.nbytes - r.plan.nbytes
    e = r.evaluation
    chosen = PlanPoint(
        f"chosen: {r.nbytes / 1e6:.2f} MB, {r.bpw:.2f} bpw",
        "chosen",
        r.nbytes,
        r.plan.objective,
        r.measured_kl,
        e.kl_mean if e is not None else None,
    )
    rows = [t for t in r.sensitivities if len(t.shape) >= 2]
    return PlotSeries(
        title=f"{r.path.name}: {r.bpw:.2f} bpw, {r.nbytes / 1e6:.2f} MB ({r.plan.method})",
        chosen=chosen,
        candidates=_candidates(r.sensitivities, recipe.search.method, overhead),
        target_size=r.target_size,
        target_bpw=8 * r.target_size / r.params if r.target_size else None,
        bpw=r.bpw,
        layers=_layers(r),
        tensors=[t.name for t in rows],
        predicted=[r.predicted.get(t.name, 0.0) for t in rows],
        measured=[r.measured.get(t.name, 0.0) for t in rows],
    )


def draw_plot(series: PlotSeries, path: Path) -> Path | None:
    """Draw ``series`` into ``path`` (PNG); None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(
        3, 1, figsize=(12, 13), gridspec_kw={"height_ratios": [4, 3, 3]}, layout="constrained"
    )
    fig.suptitle(series.title)
    _draw_tradeoff(axes[0], series)
    _draw_layers(axes[1], series, plt)
    _draw_errors(axes[2], series)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _positive(v: float) -> float:
    return v if v > 0 else float("nan")  # log axes: a zero is not drawn


def _draw_tradeoff(ax: Any, s: PlotSeries) -> None:
    for kind, marker, color in (("search", "o", "tab:blue"), ("uniform", "s", "tab:gray")):
        pts = sorted((p for p in s.candidates if p.kind == kind), key=lambda p: p.file_bytes)
        if not pts:
            continue
        xs = [p.file_bytes / 1e6 for p in pts]
        ys = [_positive(p.objective) for p in pts]
        style = "-" if kind == "search" else ""
        name = "search at other budgets" if kind == "search" else "uniform plans"
        ax.plot(xs, ys, marker=marker, linestyle=style, color=color, label=name, alpha=0.8)
        if kind == "uniform":
            for i, (p, x, y) in enumerate(zip(pts, xs, ys, strict=True)):
                dy = 4 if i % 2 == 0 else -11  # neighbours' labels on either side
                ax.annotate(p.label, (x, y), textcoords="offset points", xytext=(4, dy),
                            fontsize=7, color="dimgray")
    c = s.chosen
    cx, cy = c.file_bytes / 1e6, _positive(c.objective)
    ax.plot([cx], [cy], marker="*", markersize=18, color="tab:red", linestyle="",
            label="chosen plan (predicted)")
    ax.annotate(c.label, (cx, cy), textcoords="offset points", xytext=(12, -22),
                fontsize=9, color="tab:red", fontweight="bold",
                bbox={"boxstyle": "round", "fc": "white", "ec": "tab:red", "alpha": 0.9})
    if c.measured_kl is not None:
        ax.plot([cx], [_positive(c.measured_kl)], marker="x", markersize=10, color="tab:red",
                linestyle="", label="chosen: measured KL (probe tokens)")
    if c.eval_kl is not None:
        ax.plot([cx], [_positive(c.eval_kl)], marker="D", markersize=8, color="tab:purple",
                linestyle="", label="chosen: mean KL on held-out text")
    if s.target_size:
        ax.axvline(s.target_size / 1e6, color="black", linestyle="--",
                   label=f"size target {s.target_size / 1e6:.2f} MB")
    ax.set_yscale("log")
    ax.set_xlabel("package size (MB)")
    ax.set_ylabel("predicted error (search objective)")
    ax.set_title("size against quality")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _draw_layers(ax: Any, s: PlotSeries, plt: Any) -> None:
    colors = plt.get_cmap("tab10" if len(s.encodings) <= 10 else "tab20")
    x = list(range(len(s.layers)))
    bottom = [0.0] * len(s.layers)
    for i, label in enumerate(s.encodings):
        h = [bar.bits.get(label, 0.0) for bar in s.layers]
        ax.bar(x, h, bottom=bottom, color=colors(i), label=label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, h, strict=True)]
    if s.target_bpw:
        ax.axhline(s.target_bpw, color="black", linestyle="--",
                   label=f"target {s.target_bpw:.2f} bpw (whole file)")
    ax.axhline(s.bpw, color="tab:red", linestyle=":", label=f"written {s.bpw:.2f} bpw")
    ax.set_ylim(0, 1.45 * max([*bottom, s.target_bpw or 0.0, s.bpw]))  # room for the legend
    ax.set_xticks(x)
    ax.set_xticklabels([bar.group for bar in s.layers], fontsize=7)
    ax.set_xlabel("layer (or tensor group)")
    ax.set_ylabel("bits / weight")
    ax.set_title("bits per layer by encoding")
    ax.legend(fontsize=8, ncol=4, loc="upper right")


def _draw_errors(ax: Any, s: PlotSeries) -> None:
    x = list(range(len(s.tensors)))
    ax.semilogy(x, [_positive(v) for v in s.predicted], ".", label="predicted",
                color="tab:orange")
    ax.semilogy(x, [_positive(v) for v in s.measured], "x", label="measured",
                color="tab:green", markersize=4)
    marks = ("embed", "output")
    ticks = [i for i, n in enumerate(s.tensors) if "attn_q" in n or n.startswith(marks)]
    ax.set_xticks(ticks)
    ax.set_xticklabels([s.tensors[i].replace(".weight", "") for i in ticks], rotation=90,
                       fontsize=6)
    ax.set_ylabel("error (objective units)")
    ax.set_title("per-tensor error: predicted vs measured")
    ax.legend(fontsize=8)
