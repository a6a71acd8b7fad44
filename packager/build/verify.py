"""Phase 7, verify: the whole plan's KL against the float model on the probe tokens."""

from __future__ import annotations

from typing import Any

from ..search import Plan
from ..sensitivity import FakeQuantModel, TensorSensitivity, measure_plan_kl
from .source import FloatModel

__all__ = ["plan_kl"]


def plan_kl(
    fm: FloatModel,
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

