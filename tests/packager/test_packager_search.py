"""Mixed-precision search: budgets honoured, knapsack never worse than greedy, protected
tensors keep their encoding, latency budgets through the Lagrangian."""

from __future__ import annotations

import numpy as np
import pytest

from edgepack.format import Encoding
from edgepack.packager.encode import EncodingChoice, parse_encoding
from edgepack.packager.search import SearchError, greedy, knapsack, search
from edgepack.packager.sensitivity import Option, TensorSensitivity

LABELS = ["int2-g32-asym", "int3-g32", "int4-g32", "int4-g32-asym", "int8"]
BITS = {"int2-g32-asym": 3.0, "int3-g32": 3.5, "int4-g32": 4.5, "int4-g32-asym": 5.0, "int8": 8.1}


def _tensors(n: int = 24, seed: int = 0, fixed: set[int] = frozenset()) -> list[TensorSensitivity]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        numel = int(rng.integers(2, 40)) * 4096
        sens = float(rng.lognormal(0, 2))
        opts = []
        for label in LABELS:
            bits = BITS[label]
            err = sens * 2.0 ** (-2 * bits) * float(rng.uniform(0.7, 1.3))
            opts.append(Option(parse_encoding(label), int(numel * bits / 8), err, 0.0, 0.0))
        t = TensorSensitivity(f"layers.{i}.ffn_up.weight", (numel // 64, 64), "ffn_up", i, opts)
        if i in fixed:
            t.options = [opts[-1]]
            t.fixed = opts[-1].choice
        out.append(t)
    return out


def _exhaustive(sens, budget):
    best = None
    import itertools

    for idx in itertools.product(*[range(len(t.options)) for t in sens]):
        size = sum(t.options[i].nbytes for t, i in zip(sens, idx, strict=True))
        if size > budget:
            continue
        cost = sum(t.cost(t.options[i]) for t, i in zip(sens, idx, strict=True))
        if best is None or cost < best:
            best = cost
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("frac", [0.05, 0.3, 0.6, 0.95])
def test_knapsack_fits_and_beats_greedy(seed: int, frac: float) -> None:
    sens = _tensors(seed=seed)
    lo = sum(min(o.nbytes for o in t.options) for t in sens)
    hi = sum(max(o.nbytes for o in t.options) for t in sens)
    budget = int(lo + frac * (hi - lo))
    g = greedy(sens, budget)
    k = knapsack(sens, budget)
    assert g.nbytes <= budget and k.nbytes <= budget
    assert k.objective <= g.objective * (1 + 1e-12)
    assert k.notes["greedy_objective"] == pytest.approx(g.objective)


@pytest.mark.parametrize("seed", range(4))
def test_knapsack_is_optimal_on_small_problems(seed: int) -> None:
    sens = _tensors(n=6, seed=seed)
    lo = sum(min(o.nbytes for o in t.options) for t in sens)
    hi = sum(max(o.nbytes for o in t.options) for t in sens)
    budget = (lo + hi) // 2
    best = _exhaustive(sens, budget)
    k = knapsack(sens, budget, units=200_000)
    assert k.objective == pytest.approx(best, rel=1e-9)


def test_protected_tensors_are_honoured() -> None:
    sens = _tensors(fixed={0, 3, 7})
    lo = sum(min(o.nbytes for o in t.options) for t in sens)
    plan = knapsack(sens, lo + 10_000)
    for i in (0, 3, 7):
        assert plan.choices[sens[i].name].choice.encoding == Encoding.INT8_CHANNEL


def test_budget_below_minimum_raises() -> None:
    sens = _tensors()
    lo = sum(min(o.nbytes for o in t.options) for t in sens)
    with pytest.raises(SearchError, match="smallest possible"):
        search(sens, lo - 1)
    with pytest.raises(SearchError):
        greedy(sens, lo - 1)


def test_latency_budget_via_lagrangian() -> None:
    sens = _tensors(seed=3)
    hi = sum(max(o.nbytes for o in t.options) for t in sens)
    # pretend low-bit kernels are slow (unpacking): latency is not monotone in size
    lat_of = {"int2-g32-asym": 3.0, "int3-g32": 2.5, "int4-g32": 1.0, "int4-g32-asym": 1.1}

    def latency(t, o):
        return lat_of.get(o.label, 1.6) * t.numel / 1e5

    free = knapsack(sens, hi, latency)
    cap = free.latency_ms * 0.8
    plan = knapsack(sens, hi, latency, cap)
    assert plan.latency_ms <= cap + 1e-9
    assert plan.objective >= free.objective
    g = greedy(sens, hi, latency, cap)
    assert g.latency_ms <= cap + 1e-9
    assert plan.objective <= g.objective * (1 + 1e-12)
    with pytest.raises(SearchError, match="latency"):
        knapsack(sens, hi, latency, 1e-9)


def test_single_choice_everywhere() -> None:
    sens = _tensors(n=3)
    for t in sens:
        t.options = [t.options[2]]
    plan = knapsack(sens, sum(t.options[0].nbytes for t in sens))
    assert all(
        o.choice == EncodingChoice(Encoding.INT4_GROUP_SYM, 32) for o in plan.choices.values()
    )


def test_embedding_errors_come_from_the_builds_scale_search() -> None:
    """The build quantizes a tied embedding by the weighted scale search, so its
    candidates' head errors must be that quantizer's: plain-RTN errors overstated the
    4-bit head (about 2x in KL on SmolLM2) and the search paid for int8 instead."""
    from edgepack.packager.calibration import CalibrationStats, SiteStats
    from edgepack.packager.quantizers.gptq import output_error
    from edgepack.packager.quantizers.rtn import embedding_weights, rtn_quantize
    from edgepack.packager.sensitivity import measure_sensitivity

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((256, 64)) * rng.uniform(0.2, 2, 64)).astype(np.float32)
    x = (rng.standard_normal((512, 64)) * rng.uniform(0.1, 4, 64)).astype(np.float32)
    site = SiteStats.empty(64)
    site.add(x, rng)
    stats = CalibrationStats(sites={"embed.weight": site}, tokens=256)
    stats.token_counts = np.ones(256, np.int64)
    cands = [parse_encoding("int4-g32"), parse_encoding("int8")]

    def measure(search: bool) -> TensorSensitivity:
        (t,) = measure_sensitivity(
            ["embed.weight"],
            [(256, 64)],
            lambda name: w,
            stats,
            cands,
            tied_head="embed.weight",
            embed_search=search,
        )
        return t

    plain, searched = measure(False).option("int4-g32"), measure(True).option("int4-g32")
    assert searched.extra_err < 0.9 * plain.extra_err
    h = site.mean_hessian
    _, deq = rtn_quantize(w, cands[0], embedding_weights(h), True)
    assert searched.extra_err == pytest.approx(output_error(deq - w, h), rel=1e-4)
    assert measure(True).option("int8").extra_err == measure(False).option("int8").extra_err
