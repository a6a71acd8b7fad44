"""What a build reports while it runs (:class:`Progress`) and when it is done
(:class:`BuildResult`: the summary, timings and peak memory)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..evaluate import EvalResult
from ..prefix import PrefixCacheInfo
from ..search import Plan
from ..sensitivity import TensorSensitivity

__all__ = ["BuildResult", "Progress"]


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
    fallbacks: dict[str, str] = field(default_factory=dict)  # tensor -> why (budget.py)
    prefix_caches: list[PrefixCacheInfo] = field(default_factory=list)
    evaluation: EvalResult | None = None  # on held-out text vs the float model (--eval)
    eval_file: str | None = None

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
        lines += self.evaluation_lines()
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in self.phases.items())
        lines.append(f"time {sum(self.phases.values()):.1f}s ({phases})")
        lines.append(f"peak RSS {self.peak_rss / 2**20:.0f} MiB")
        lines += [c.summary() for c in self.prefix_caches]
        lines += [f"note: {name}: {why}" for name, why in self.fallbacks.items()]
        return lines


    def evaluation_lines(self) -> list[str]:
        """The held-out quality against the float model, or nothing without --eval."""
        e = self.evaluation
        if e is None:
            return []
        return [
            f"eval on {Path(self.eval_file or '').name} ({e.tokens} tokens, ctx {e.ctx}): "
            f"PPL {e.ppl:.4f} (float {e.ref_ppl:.4f}), mean KL {e.kl_mean:.5f}, "
            f"top-1 {100 * (e.top1 or 0.0):.2f} %"
        ]

    def to_json(self) -> dict[str, Any]:
        """What ``build --json`` prints and ``OUT.report.json`` holds."""
        e = self.evaluation
        return {
            "path": str(self.path),
            "size": self.nbytes,
            "params": self.params,
            "bits_per_weight": self.bpw,
            "target_size": self.target_size,
            "predicted_kl": self.predicted_kl,
            "measured_kl": self.measured_kl,
            "encodings": {
                label: {"tensors": n, "params": p}
                for label, (n, p) in self.encoding_counts().items()
            },
            "fallbacks": self.fallbacks,
            "evaluation": None if e is None else {
                "text": self.eval_file,
                "ppl": e.ppl,
                "ppl_stderr": e.ppl_stderr,
                "float_ppl": e.ref_ppl,
                "kl_mean": e.kl_mean,
                "kl_stderr": e.kl_stderr,
                "top1": e.top1,
                "tokens": e.tokens,
                "chunks": e.chunks,
                "ctx": e.ctx,
            },
            "phases_seconds": self.phases,
            "peak_rss_bytes": self.peak_rss,
            "report": str(self.report_path) if self.report_path else None,
            "plot": str(self.plot_path) if self.plot_path else None,
            "prefix_caches": [c.to_json() for c in self.prefix_caches],
        }
