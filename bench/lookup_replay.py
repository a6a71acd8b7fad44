"""Replay ``bench/runtime.py --lookup``'s task without timing noise.

Lookup decoding's output is plain greedy decoding's, so once the plain outputs are known
(``--record``: one greedy run per paragraph and package, kept as JSON) every verify pass
the decoder would make can be replayed without the model: a drafted token is accepted
exactly when it is the next token of the plain output. The replay runs the real
:class:`LookupDecoder` and policy (warm-up and ``--runs`` runs sharing one acceptance
table, as the bench does) with the pass costs fixed to measured ratios
(``--costs-int8``/``--costs-int4``: a decode step = 1), and prints accepted/drafted, the
passes by size, the speedup the pass count predicts (plain steps over the summed cost of
the passes) and, ``--verbose``, per matched suffix length the drafts rejected at once and
the per-token acceptance against the policy's estimate of it.

``--oracle`` adds what a perfect drafter would reach: at each position the longest run
of the true continuation that some earlier occurrence (draft sources, prompt and text so
far) could have drafted, the cheapest schedule of passes over those runs with the same
pass costs (also of the occurrences the decoder chooses: what a perfect draft length
would reach), and where the real decoder's passes lose against the runs (no match found,
the policy drafting nothing, a wrong occurrence, a draft too long or too short).

``--noise P`` has the policy time the passes itself, as a session does, on a busy host:
each pass's time is its cost with a lognormal jitter (sigma 0.15) and, with chance ``P``,
a spike of 2-4x (another process on the core); the speedup is still counted at the
fixed costs, so what it shows is what misjudging the costs loses.

    python bench/lookup_replay.py --record [--int8 PKG] [--int4 PKG]   # ~1 min
    python bench/lookup_replay.py --costs-int4 1,1.23,...  [--verbose] [--oracle]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime import _packages, _paragraphs, _rewrite_prompt

# pass cost by token count (1..9) relative to one decode step: int8 measured on this
# machine (after 200 tokens, native kernels, 2 threads, busy); int4 of the build of
# 2026-12-02 (T = 4/5/8 ~1.5/1.65/2.2 as measured for issue 14, the sizes between from
# paired T-vs-1 timings on a busy host, medians)
DEFAULT_COSTS = {
    "int8": [1.0, 1.15, 1.22, 1.33, 1.4, 1.52, 1.65, 1.75, 2.0],
    "int4": [1.0, 1.3, 1.4, 1.5, 1.65, 1.85, 2.0, 2.2, 2.5],
}


def record(args: argparse.Namespace, out: Path) -> None:
    from edgepack import runtime_shim as rt

    pkgs = _packages(args)
    data: dict[str, dict] = {}
    for key, path in pkgs.items():
        model = rt.open(path, threads=args.threads, kernels="native")
        items = []
        for para in _paragraphs(args.paragraphs):
            prompt = _rewrite_prompt(model, para)
            with model.session() as s:
                ids = list(s.generate(prompt, args.max_tokens, lookup=False))
                finish = s.stats.finish_reason
            stops = sorted(model.stop_token_ids())
            items.append({"prompt": prompt, "output": ids, "finish": finish, "stops": stops})
        data[key] = {"path": str(path), "max_tokens": args.max_tokens, "items": items}
        model.close()
    out.write_text(json.dumps(data))
    print(f"recorded {out}")


def _truth(item: dict, max_tokens: int) -> list[int]:
    """The tokens a call generates: the plain output, with its stop token when it ended."""
    out = item["output"][:max_tokens]
    ended = item["finish"] != "length" and len(out) == len(item["output"])
    return out + ([item["stops"][0]] if ended else [])  # the stop token is generated too


def copy_runs(context: list[int], truth: list[int], back: int = 0) -> list[int]:
    """``runs[i]``: the longest ``L`` with ``truth[i:i + L]`` occurring in ``context +
    truth[:i]`` (what a drafter that always picked the best occurrence could copy at i),
    of the occurrences whose ``back`` tokens before agree with the context's last ones
    (0: any; n: those an n-gram suffix match finds)."""
    seq = context + truth
    runs = []
    for i in range(len(truth)):
        end, best = len(context) + i, 0
        for s in range(back, end):
            if seq[s - back : s] != seq[end - back : end]:
                continue
            n = 0
            while s + n < end and end + n < len(seq) and seq[s + n] == seq[end + n]:
                n += 1
            best = max(best, n)
        runs.append(best)
    return runs


def oracle_cost(runs: list[int], cost: list[float]) -> float:
    """The least summed pass cost of generating ``truth[1:]`` (the first token comes from
    the prefill) when a pass at ``i`` may carry any draft up to ``runs[i]``, all accepted."""
    n = len(runs)
    best = [0.0] * (n + 1)
    for i in range(n - 1, 0, -1):
        top = min(runs[i], len(cost) - 1, n - 1 - i)
        best[i] = min(cost[k] + best[i + k + 1] for k in range(top + 1))
    return best[1] if n > 1 else 0.0


def found_runs(lk_mod, item: dict, sources, ends, max_tokens: int, max_draft: int) -> list[int]:
    """``runs[i]``: how many of the draft the decoder's index finds at ``i`` (of its
    chosen occurrence, up to ``max_draft``) are right: what it would carry if the policy
    always knew the right draft length."""
    truth = _truth(item, max_tokens)
    stops = frozenset(item["stops"])
    dec = lk_mod.LookupDecoder(
        lk_mod.LookupPolicy(), item["prompt"], None, sources=sources, ends=ends | stops,
        stops=stops,
    )
    runs = []
    for i, t in enumerate(truth):
        runs.append(_right(dec.index.match(max_draft)[0], truth[i:]))
        dec.index.push(t)
    return runs


def _right(draft: list[int], future: list[int]) -> int:
    """How many of ``draft``'s first tokens are ``future``'s."""
    n = 0
    while n < min(len(draft), len(future)) and draft[n] == future[n]:
        n += 1
    return n


def _losses(dec, draft: list[int], future: list[int], run: int, limit: int,
            tot: collections.Counter) -> None:
    """Sort one pass against the copyable ``run``: the tokens it missed or wasted."""
    cap = min(run, dec.policy.max_draft, limit)
    acc = _right(draft, future)
    if not draft:
        if cap:
            found = dec.index.match(min(dec.policy.max_draft, limit))[0]
            if not found:
                tot["missed", "no match found"] += cap
            else:
                tot["missed", "policy drafted nothing"] += cap
                tot["missed", "  of which the draft found had right"] += _right(found, future)
        return
    if acc < len(draft):
        tot["wasted", "rejected draft tokens"] += len(draft) - acc
        if acc < cap:
            tot["missed", "wrong occurrence"] += cap - acc
    elif acc < cap:
        found = dec.index.match(min(dec.policy.max_draft, limit))[0]
        why = (
            "policy's length" if len(found) > len(draft)
            else "line break / stop" if found[-1] in dec.index.ends else "source's end"
        )
        tot["missed", f"draft too short ({why})"] += cap - acc


def _call(lk_mod, policy, item: dict, sources, ends, cost: list[float], max_tokens: int,
          tot: collections.Counter, sizes: collections.Counter,
          runs: list[int] | None = None, timer=None) -> tuple[int, float]:
    """One generate call replayed: (plain decode steps, summed cost of its passes); with
    ``runs`` (:func:`copy_runs`) it sorts the passes' losses into ``tot`` too; with
    ``timer`` (a pass's cost -> the seconds it is timed at) the decoder times its passes."""
    truth = _truth(item, max_tokens)
    stops = frozenset(item["stops"])  # as the session has them
    dec = lk_mod.LookupDecoder(
        policy, item["prompt"], None, sources=sources, ends=ends | stops, stops=stops
    )
    gen = [truth[0]]  # the first token comes from the prefill
    dec.push(truth[0])
    spent = 0.0
    while len(gen) < len(truth):
        limit = max_tokens - len(gen) - 1
        draft = dec.propose(limit)
        at = len(gen)
        acc = _right(draft, truth[at:])
        if runs is not None:
            _losses(dec, draft, truth[at:], runs[at], limit, tot)
        sizes[len(draft) + 1] += 1
        spent += cost[len(draft)]
        if timer is not None:
            dec.timed(len(draft) + 1, timer(cost[len(draft)]))
        if draft:
            m = dec.matched
            tot["drafted", m] += len(draft)
            tot["accepted", m] += acc
            tot["trials", m] += acc + (acc < len(draft))  # up to the first rejection
            tot["rejected at once", m] += acc == 0
            dec.verified(len(draft), acc)
        for t in truth[at : at + acc + 1]:
            gen.append(t)
            dec.push(t)
    return len(truth) - 1, spent


def _busy_timer(noise: float, seed: int = 0):
    """A pass's cost -> the seconds a busy host times it at (``--noise``)."""
    rng = random.Random(seed)

    def timer(c: float) -> float:
        spike = rng.uniform(2.0, 4.0) if rng.random() < noise else 1.0
        return c * spike * rng.lognormvariate(0.0, 0.15)

    return timer


def replay(
    data: dict, costs: dict[str, list[float]], runs: int, verbose: bool, oracle: bool = False,
    noise: float | None = None,
) -> None:
    from edgepack import runtime_shim as rt
    from edgepack.runtime_shim import lookup as lk_mod

    for key, entry in data.items():
        model = rt.open(entry["path"], threads=1, kernels="numpy")  # its tokenizer only
        sources = [lk_mod.draft_sources(model, it["prompt"]) for it in entry["items"]]
        ends = lk_mod.draft_ends(model)
        model.close()
        cost = costs[key]
        pcosts = lk_mod.PassCosts()
        timer = None
        if noise is None:
            pcosts.seconds.update(enumerate(cost, 1))
        else:
            timer = _busy_timer(noise)
        counts: dict[int, tuple[float, float]] = {}  # shared by the calls, as per model
        runs_last = runs - 1
        for run in range(-1, runs):  # -1: the bench's warm-up (16 tokens each)
            max_tokens = 16 if run < 0 else entry.get("max_tokens", 128)
            tot: collections.Counter = collections.Counter()
            sizes: collections.Counter[int] = collections.Counter()
            plain_steps, spent = 0, 0.0
            best = 0.0  # the oracle's summed pass cost
            by_back = collections.Counter()  # the same, of occurrences an n-gram match finds
            chosen = 0.0  # the same, of the occurrences the decoder chooses
            for item, src in zip(entry["items"], sources, strict=True):
                policy = lk_mod.LookupPolicy(costs=pcosts, counts=counts)
                copyable = None
                if oracle and run == runs_last:
                    ctx = [*(t for s in src for t in s), *item["prompt"]]
                    copyable = copy_runs(ctx, _truth(item, max_tokens))
                    best += oracle_cost(copyable, cost)
                    for n in (1, 2, 3):
                        by_back[n] += oracle_cost(copy_runs(ctx, _truth(item, max_tokens), n), cost)
                    found = found_runs(lk_mod, item, src, ends, max_tokens, policy.max_draft)
                    chosen += oracle_cost(found, cost)
                steps, s = _call(
                    lk_mod, policy, item, src, ends, cost, max_tokens, tot, sizes, copyable, timer
                )
                plain_steps, spent = plain_steps + steps, spent + s
            accepted = sum(v for (what, _), v in tot.items() if what == "accepted")
            drafted = sum(v for (what, _), v in tot.items() if what == "drafted")
            label = "warm-up" if run < 0 else f"run {run}"
            print(
                f"{key} {label}: accepted/drafted {accepted}/{drafted}, passes plain/lookup "
                f"{plain_steps}/{sum(sizes.values())}, lookup passes by size "
                f"{dict(sorted(sizes.items()))}, predicted speedup {plain_steps / spent:.2f}x"
            )
            if best:
                print(
                    f"   oracle (every copyable run drafted, cheapest passes): predicted "
                    f"speedup {plain_steps / best:.2f}x (of occurrences after a suffix match of "
                    + ", ".join(f"{n}: {plain_steps / c:.2f}x" for n, c in sorted(by_back.items()))
                    + f"; of the decoder's occurrences: {plain_steps / chosen:.2f}x); tokens by "
                    "what the passes did:"
                )
                for (what, why), v in sorted(tot.items()):
                    if what in ("missed", "wasted"):
                        print(f"     {what} {why}: {v}")
            if verbose and run == runs_last:
                table = policy.counts
                for m in sorted({m for what, m in tot if what == "drafted"}):
                    est = table.get(m, table[0])
                    rate = tot["accepted", m] / tot["trials", m]
                    print(
                        f"   after a {abs(m)}-token match"
                        f"{' (occurrences disagree)' if m < 0 else ''}: accepted/drafted "
                        f"{tot['accepted', m]}/{tot['drafted', m]}, rejected at once "
                        f"{tot['rejected at once', m]}, per token {rate:.2f} "
                        f"(policy's estimate at the end {est[0] / est[1]:.2f})"
                    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--data", default="/tmp/lookup_replay.json")
    ap.add_argument("--int8")
    ap.add_argument("--int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paragraphs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--costs-int8")
    ap.add_argument("--costs-int4")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--oracle", action="store_true", help="a perfect drafter's figures too")
    ap.add_argument("--noise", type=float, help="the policy times passes, spikes at this chance")
    args = ap.parse_args()
    if args.record:
        record(args, Path(args.data))
        return 0
    costs = dict(DEFAULT_COSTS)
    for key in ("int8", "int4"):
        given = getattr(args, f"costs_{key}")
        if given:
            costs[key] = [float(x) for x in given.split(",")]
            if len(costs[key]) < 9:
                ap.error(f"--costs-{key}: 9 costs, of passes of 1..9 tokens")
    data = json.loads(Path(args.data).read_text())
    replay(data, costs, args.runs, args.verbose, args.oracle, args.noise)
    return 0


if __name__ == "__main__":
    sys.exit(main())
