"""The precision-plan section: per-tensor choice, reason, sensitivities, predicted vs
measured error, and the search's figures."""

from __future__ import annotations

from typing import Any

from ..recipe import Recipe
from ..search import Plan
from ..sensitivity import TensorSensitivity

__all__ = ["plan_doc"]


def plan_doc(
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

