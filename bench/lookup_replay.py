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

    python bench/lookup_replay.py --record [--int8 PKG] [--int4 PKG]   # ~1 min
    python bench/lookup_replay.py --costs-int4 1,1.23,...  [--verbose]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime import _packages, _paragraphs, _rewrite_prompt

# pass cost by token count (1..9) relative to one decode step: int8 measured on this
# machine (after 200 tokens, native kernels, 2 threads, busy), int4 T = 2/4/5/8 from the
# issue's measurement, the sizes between interpolated
DEFAULT_COSTS = {
    "int8": [1.0, 1.15, 1.22, 1.33, 1.4, 1.52, 1.65, 1.75, 2.0],
    "int4": [1.0, 1.23, 1.34, 1.45, 1.53, 1.78, 2.05, 2.31, 2.5],
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


def _call(lk_mod, policy, item: dict, sources, ends, cost: list[float], max_tokens: int,
          tot: collections.Counter, sizes: collections.Counter) -> tuple[int, float]:
    """One generate call replayed: (plain decode steps, summed cost of its passes)."""
    out = item["output"][:max_tokens]
    ended = item["finish"] != "length" and len(out) == len(item["output"])
    truth = out + ([item["stops"][0]] if ended else [])  # the stop token is generated too
    ends = ends | set(item["stops"])  # as the session has them
    dec = lk_mod.LookupDecoder(policy, item["prompt"], None, sources=sources, ends=ends)
    gen = [truth[0]]  # the first token comes from the prefill
    dec.push(truth[0])
    spent = 0.0
    while len(gen) < len(truth):
        draft = dec.propose(max_tokens - len(gen) - 1)
        at, acc = len(gen), 0
        while acc < len(draft) and at + acc < len(truth) and draft[acc] == truth[at + acc]:
            acc += 1
        sizes[len(draft) + 1] += 1
        spent += cost[len(draft)]
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


def replay(data: dict, costs: dict[str, list[float]], runs: int, verbose: bool) -> None:
    from edgepack import runtime_shim as rt
    from edgepack.runtime_shim import lookup as lk_mod

    for key, entry in data.items():
        model = rt.open(entry["path"], threads=1, kernels="numpy")  # its tokenizer only
        sources = [lk_mod.draft_sources(model, it["prompt"]) for it in entry["items"]]
        ends = lk_mod.draft_ends(model)
        model.close()
        cost = costs[key]
        pcosts = lk_mod.PassCosts()
        pcosts.seconds.update(enumerate(cost, 1))
        counts: dict[int, tuple[float, float]] = {}  # shared by the calls, as per model
        for run in range(-1, runs):  # -1: the bench's warm-up (16 tokens each)
            max_tokens = 16 if run < 0 else entry.get("max_tokens", 128)
            tot: collections.Counter = collections.Counter()
            sizes: collections.Counter[int] = collections.Counter()
            plain_steps, spent = 0, 0.0
            for item, src in zip(entry["items"], sources, strict=True):
                policy = lk_mod.LookupPolicy(costs=pcosts, counts=counts)
                steps, s = _call(lk_mod, policy, item, src, ends, cost, max_tokens, tot, sizes)
                plain_steps, spent = plain_steps + steps, spent + s
            accepted = sum(v for (what, _), v in tot.items() if what == "accepted")
            drafted = sum(v for (what, _), v in tot.items() if what == "drafted")
            label = "warm-up" if run < 0 else f"run {run}"
            print(
                f"{key} {label}: accepted/drafted {accepted}/{drafted}, passes plain/lookup "
                f"{plain_steps}/{sum(sizes.values())}, lookup passes by size "
                f"{dict(sorted(sizes.items()))}, predicted speedup {plain_steps / spent:.2f}x"
            )
            if verbose and run == runs - 1:
                table = policy.counts
                for m in sorted({m for _, m in tot}):
                    est = table.get(m, table[0])
                    rate = tot["accepted", m] / tot["trials", m]
                    print(
                        f"   after a {m}-token match: accepted/drafted "
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
    replay(json.loads(Path(args.data).read_text()), costs, args.runs, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
