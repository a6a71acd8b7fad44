"""Mixed-precision search: one option per tensor, minimal predicted error within budgets.

The problem is a multiple-choice knapsack: every tensor ``t`` picks one option ``o``
(an encoding, or a low-rank factorization) with a size ``s_to`` (bytes in the file),
an objective cost ``c_to`` (importance-weighted predicted error, :mod:`.sensitivity`) and
optionally a predicted latency ``l_to`` (from the device LUT, :mod:`.profile_device`);
minimise ``sum c`` subject to ``sum s <= size budget`` and ``sum l <= latency budget``.
Protected tensors have a single option.

* :func:`greedy` (the baseline): start every tensor at its smallest option and keep
  taking the upgrade with the largest cost decrease per added byte (along each tensor's
  lower convex hull), then fill what is left with any upgrade that still fits.
* :func:`knapsack`: exact dynamic programming over the size budget discretised in
  ``units`` steps (sizes rounded *up*, so the result always fits), the latency budget
  through a Lagrange multiplier found by bisection, then the same exact-size fill.
  It also runs the greedy and returns the better plan, so it is never worse.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import SearchError
from .sensitivity import Option, TensorSensitivity

__all__ = ["Plan", "SearchError", "greedy", "knapsack", "search"]

LatencyFn = Callable[[TensorSensitivity, Option], float]


@dataclass
class Plan:
    choices: dict[str, Option]
    nbytes: int
    objective: float
    latency_ms: float | None
    method: str
    notes: dict[str, float] = field(default_factory=dict)


def _lat(fn: LatencyFn | None, t: TensorSensitivity, o: Option) -> float:
    return fn(t, o) if fn is not None else 0.0


def _evaluate(
    sens: Sequence[TensorSensitivity], idx: Sequence[int], latency: LatencyFn | None, method: str
) -> Plan:
    choices = {t.name: t.options[i] for t, i in zip(sens, idx, strict=True)}
    nbytes = sum(o.nbytes for o in choices.values())
    obj = sum(t.cost(t.options[i]) for t, i in zip(sens, idx, strict=True))
    lat = None
    if latency is not None:
        lat = sum(_lat(latency, t, t.options[i]) for t, i in zip(sens, idx, strict=True))
    return Plan(choices, nbytes, obj, lat, method)


def _smallest(t: TensorSensitivity, latency: LatencyFn | None) -> int:
    return min(
        range(len(t.options)),
        key=lambda i: (t.options[i].nbytes, _lat(latency, t, t.options[i]), t.cost(t.options[i])),
    )


def _check_feasible(
    sens: Sequence[TensorSensitivity],
    budget: int,
    latency: LatencyFn | None,
    latency_budget: float | None,
) -> None:
    smallest = sum(min(o.nbytes for o in t.options) for t in sens)
    if smallest > budget:
        raise SearchError(
            f"size budget of {budget:,} tensor bytes is below the smallest possible "
            f"({smallest:,} bytes with every tensor at its smallest candidate)"
        )
    if latency is not None and latency_budget is not None:
        fastest = sum(min(_lat(latency, t, o) for o in t.options) for t in sens)
        if fastest > latency_budget:
            raise SearchError(
                f"latency budget {latency_budget:.3f} ms is below the fastest possible "
                f"({fastest:.3f} ms predicted by the LUT)"
            )


def _hull(t: TensorSensitivity) -> list[int]:
    """Indices of the lower convex hull of (bytes, cost), by increasing bytes."""
    pts = sorted(range(len(t.options)), key=lambda i: (t.options[i].nbytes, t.cost(t.options[i])))
    frontier: list[int] = []
    for i in pts:  # Pareto: strictly cheaper than everything smaller
        if not frontier or t.cost(t.options[i]) < t.cost(t.options[frontier[-1]]):
            if frontier and t.options[i].nbytes == t.options[frontier[-1]].nbytes:
                frontier[-1] = i
            else:
                frontier.append(i)
    hull: list[int] = []
    for i in frontier:
        while len(hull) >= 2:
            a, b = t.options[hull[-2]], t.options[hull[-1]]
            c = t.options[i]
            ca, cb, cc = t.cost(a), t.cost(b), t.cost(c)
            # b is above the segment a-c: drop it
            if (cb - ca) * (c.nbytes - a.nbytes) >= (cc - ca) * (b.nbytes - a.nbytes):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def _fill(
    sens: Sequence[TensorSensitivity],
    idx: list[int],
    budget: int,
    latency: LatencyFn | None,
    latency_budget: float | None,
) -> list[int]:
    """Repeatedly take the single option change with the best cost decrease per byte that
    still fits (exact sizes): uses the slack left by discretisation or hull steps."""
    used = sum(t.options[i].nbytes for t, i in zip(sens, idx, strict=True))
    lat = sum(_lat(latency, t, t.options[i]) for t, i in zip(sens, idx, strict=True))
    while True:
        best = None
        for k, t in enumerate(sens):
            cur = t.options[idx[k]]
            for j, o in enumerate(t.options):
                gain = t.cost(cur) - t.cost(o)
                if gain <= 0:
                    continue
                extra = o.nbytes - cur.nbytes
                if used + extra > budget:
                    continue
                dl = _lat(latency, t, o) - _lat(latency, t, cur)
                if latency_budget is not None and latency is not None and lat + dl > latency_budget:
                    continue
                score = gain / max(extra, 1)
                if best is None or score > best[0]:
                    best = (score, k, j, extra, dl)
        if best is None:
            return idx
        _, k, j, extra, dl = best
        idx[k] = j
        used += extra
        lat += dl


def _repair_latency(
    sens: Sequence[TensorSensitivity],
    idx: list[int],
    budget: int,
    latency: LatencyFn,
    latency_budget: float,
) -> list[int]:
    """From a latency-infeasible start, take the changes saving the most latency per
    added byte (within the size budget) until the latency budget is met."""
    idx = list(idx)
    used = sum(t.options[i].nbytes for t, i in zip(sens, idx, strict=True))
    lat = sum(latency(t, t.options[i]) for t, i in zip(sens, idx, strict=True))
    while lat > latency_budget:
        best = None
        for k, t in enumerate(sens):
            cur = t.options[idx[k]]
            for j, o in enumerate(t.options):
                saved = latency(t, cur) - latency(t, o)
                extra = o.nbytes - cur.nbytes
                if saved <= 0 or used + extra > budget:
                    continue
                score = saved / max(extra, 1)
                if best is None or score > best[0]:
                    best = (score, k, j, extra, saved)
        if best is None:
            raise SearchError("no plan meets the latency budget within the size budget")
        _, k, j, extra, saved = best
        idx[k] = j
        used += extra
        lat -= saved
    return idx


def greedy(
    sens: Sequence[TensorSensitivity],
    budget: int,
    latency: LatencyFn | None = None,
    latency_budget: float | None = None,
) -> Plan:
    """The baseline: upgrades in order of cost decrease per byte, then a fill."""
    _check_feasible(sens, budget, latency, latency_budget)
    hulls = [_hull(t) for t in sens]
    pos = [0] * len(sens)
    idx = [h[0] for h in hulls]
    if latency is not None and latency_budget is not None:
        idx = _repair_latency(sens, idx, budget, latency, latency_budget)
        for k, t in enumerate(sens):  # continue along each hull from the repaired option
            cur = t.options[idx[k]]
            pos[k] = max(p for p, i in enumerate(hulls[k]) if t.options[i].nbytes <= cur.nbytes)
    used = sum(t.options[i].nbytes for t, i in zip(sens, idx, strict=True))
    lat = sum(_lat(latency, t, t.options[i]) for t, i in zip(sens, idx, strict=True))
    heap: list[tuple[float, int]] = []

    def push(k: int) -> None:
        h, p = hulls[k], pos[k]
        if p + 1 < len(h) and sens[k].options[h[p + 1]].nbytes > sens[k].options[idx[k]].nbytes:
            t = sens[k]
            a, b = t.options[h[p]], t.options[h[p + 1]]
            ratio = (t.cost(a) - t.cost(b)) / max(b.nbytes - a.nbytes, 1)
            heapq.heappush(heap, (-ratio, k))

    for k in range(len(sens)):
        push(k)
    while heap:
        _, k = heapq.heappop(heap)
        t, h = sens[k], hulls[k]
        a, b = t.options[idx[k]], t.options[h[pos[k] + 1]]
        if t.cost(b) >= t.cost(a):
            pos[k] += 1
            push(k)
            continue
        extra = b.nbytes - a.nbytes
        dl = _lat(latency, t, b) - _lat(latency, t, a)
        if used + extra > budget:
            continue
        if latency is not None and latency_budget is not None and lat + dl > latency_budget:
            continue
        pos[k] += 1
        idx[k] = h[pos[k]]
        used += extra
        lat += dl
        push(k)
    idx = _fill(sens, idx, budget, latency, latency_budget)
    return _evaluate(sens, idx, latency, "greedy")


def _dp(
    sens: Sequence[TensorSensitivity],
    budget: int,
    units: int,
    mu: float,
    latency: LatencyFn | None,
) -> list[int]:
    """Exact multiple-choice knapsack on sizes rounded to ``budget/units`` steps,
    minimising ``cost + mu * latency``. Sizes are rounded to the nearest step and the
    capacity lowered by a few steps (rounding errors add up like a random walk); the
    caller repairs the rare overshoot with exact sizes."""
    base = [min(o.nbytes for o in t.options) for t in sens]
    capacity = budget - sum(base)
    step = max(1, math.ceil(capacity / units)) if capacity > 0 else 1
    free = sum(1 for t in sens if len(t.options) > 1)
    cap = max(0, capacity // step - math.ceil(2 * math.sqrt(free)))
    inf = np.inf
    dp = np.full(cap + 1, inf)
    dp[0] = 0.0
    if any(len(t.options) > 127 for t in sens):
        raise ValueError("at most 127 options per tensor")
    choice = np.zeros((len(sens), cap + 1), np.int8)
    for k, t in enumerate(sens):
        if len(t.options) == 1:  # fixed: nothing to choose (its size is in the base)
            continue
        new = np.full(cap + 1, inf)
        arg = np.zeros(cap + 1, np.int8)
        for j, o in enumerate(t.options):
            w = round((o.nbytes - base[k]) / step)
            if w > cap:
                continue
            v = t.cost(o) + mu * _lat(latency, t, o)
            cand = np.full(cap + 1, inf)
            cand[w:] = dp[: cap + 1 - w] + v
            better = cand < new
            new[better] = cand[better]
            arg[better] = j
        dp = new
        choice[k] = arg
    b = int(np.argmin(dp))
    idx = [0] * len(sens)
    for k in range(len(sens) - 1, -1, -1):
        j = int(choice[k, b])
        idx[k] = j
        b -= round((sens[k].options[j].nbytes - base[k]) / step)
    return idx


def _shrink(
    sens: Sequence[TensorSensitivity],
    idx: list[int],
    budget: int,
    latency: LatencyFn | None,
    latency_budget: float | None,
) -> list[int]:
    """Over the size budget (exact sizes): take the downgrades costing the least per byte
    saved (never breaking the latency budget) until the plan fits."""
    idx = list(idx)
    used = sum(t.options[i].nbytes for t, i in zip(sens, idx, strict=True))
    lat = sum(_lat(latency, t, t.options[i]) for t, i in zip(sens, idx, strict=True))
    while used > budget:
        best = None
        for k, t in enumerate(sens):
            cur = t.options[idx[k]]
            for j, o in enumerate(t.options):
                saved = cur.nbytes - o.nbytes
                if saved <= 0:
                    continue
                dl = _lat(latency, t, o) - _lat(latency, t, cur)
                if latency_budget is not None and latency is not None and lat + dl > latency_budget:
                    continue
                score = (t.cost(o) - t.cost(cur)) / saved
                if best is None or score < best[0]:
                    best = (score, k, j, saved, dl)
        if best is None:
            raise SearchError("no plan fits the size budget")
        _, k, j, saved, dl = best
        idx[k] = j
        used -= saved
        lat += dl
    return idx


def knapsack(
    sens: Sequence[TensorSensitivity],
    budget: int,
    latency: LatencyFn | None = None,
    latency_budget: float | None = None,
    units: int = 100_000,
) -> Plan:
    """Exact (discretised) DP with a Lagrangian latency term; never worse than greedy."""
    _check_feasible(sens, budget, latency, latency_budget)

    def lat_of(idx: list[int]) -> float:
        return sum(_lat(latency, t, t.options[i]) for t, i in zip(sens, idx, strict=True))

    idx = _dp(sens, budget, units, 0.0, latency)
    mu_used = 0.0
    if latency is not None and latency_budget is not None and lat_of(idx) > latency_budget:
        # bisection on the multiplier: the smallest mu whose plan meets the latency budget
        scale = sum(t.cost(o) for t in sens for o in t.options) or 1.0
        lo, hi = 0.0, scale
        best = None
        for _ in range(60):
            cand = _dp(sens, budget, units, hi, latency)
            if lat_of(cand) <= latency_budget:
                best = cand
                break
            lo, hi = hi, hi * 10
        if best is None:
            raise SearchError("no plan meets the latency budget within the size budget")
        for _ in range(30):
            mid = (lo + hi) / 2
            cand = _dp(sens, budget, units, mid, latency)
            if lat_of(cand) <= latency_budget:
                best, hi = cand, mid
            else:
                lo = mid
        idx, mu_used = best, hi
    idx = _shrink(sens, list(idx), budget, latency, latency_budget)
    idx = _fill(sens, idx, budget, latency, latency_budget)
    plan = _evaluate(sens, idx, latency, "knapsack")
    base = greedy(sens, budget, latency, latency_budget)
    plan.notes = {"greedy_objective": base.objective, "knapsack_objective": plan.objective}
    if latency is not None:
        plan.notes["lagrange_mu"] = mu_used
    if base.objective < plan.objective:  # discretisation can lose a sliver: keep the best
        base.notes = dict(plan.notes)
        base.method = "knapsack (greedy was better)"
        return base
    return plan


def search(
    sens: Sequence[TensorSensitivity],
    budget: int,
    method: str = "knapsack",
    latency: LatencyFn | None = None,
    latency_budget: float | None = None,
) -> Plan:
    if method == "greedy":
        return greedy(sens, budget, latency, latency_budget)
    if method == "knapsack":
        return knapsack(sens, budget, latency, latency_budget)
    raise ValueError(f"unknown search method {method!r}")
