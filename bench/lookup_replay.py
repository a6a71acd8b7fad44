"""Replay ``bench/runtime.py --lookup``'s task without timing noise.

Lookup decoding's output is plain greedy decoding's, so once the plain outputs are known
(``--record``: one greedy run per paragraph and package, kept as JSON) every verify pass
the decoder would make can be replayed without the model: a drafted token is accepted
exactly when it is the next token of the plain output. The replay runs the real
:class:`LookupDecoder` and policy (warm-up and ``--runs`` runs sharing one acceptance
table, as the bench does) with the pass costs fixed to measured ratios (``--costs``:
a decode step = 1), and prints accepted/drafted, the passes by size, what failed
(matched suffix length, source of the draft) and the speedup the pass count predicts:
plain steps over the summed cost of the passes.

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

# pass cost by token count (1..9) relative to one decode step, measured on this machine
# (/tmp/costT.py-style: after 200 tokens, native kernels, 2 threads); filled by --measure
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
        data[key] = {"path": str(path), "items": items}
        model.close()
    out.write_text(json.dumps(data))
    print(f"recorded {out}")


class _Tok:
    """The package's tokenizer loaded once (reflowing the prompt needs it)."""

    def __init__(self, path: str) -> None:
        from edgepack import runtime_shim as rt

        self.model = rt.open(path, threads=1, kernels="numpy")


def replay(data: dict, costs: dict[str, list[float]], runs: int, verbose: bool) -> None:
    from edgepack.runtime_shim import lookup as lk_mod

    for key, entry in data.items():
        tok = _Tok(entry["path"])
        sources = [lk_mod.draft_sources(tok.model, it["prompt"]) for it in entry["items"]]
        ends = lk_mod.draft_ends(tok.model)
        cost = costs[key]
        pcosts = lk_mod.PassCosts()
        for t, c in enumerate(cost, 1):
            pcosts.seconds[t] = c
        counts: dict[int, tuple[float, float]] = {}
        for run in range(-1, runs):  # -1: the bench's warm-up (16 tokens each)
            max_tokens = 16 if run < 0 else 128
            tot = collections.Counter()
            sizes: collections.Counter[int] = collections.Counter()
            fails: collections.Counter[tuple] = collections.Counter()
            plain_steps, cost_sum = 0, 0.0
            for it, src in zip(entry["items"], sources, strict=True):
                out = it["output"][:max_tokens]
                truth = out + ([] if it["finish"] == "length" or len(out) < len(it["output"])
                               else [it["stops"][0]])
                policy = lk_mod.LookupPolicy(costs=pcosts, counts=counts)
                dec = lk_mod.LookupDecoder(policy, it["prompt"], None, sources=src, ends=ends)
                gen = [truth[0]]
                dec.push(truth[0])
                n = len(truth)
                plain_steps += n - 1
                while len(gen) < n:
                    room = max_tokens - len(gen) - 1
                    draft = dec.propose(room)
                    if not draft:
                        sizes[1] += 1
                        cost_sum += cost[0]
                        gen.append(truth[len(gen)])
                        dec.push(gen[-1])
                        continue
                    at = len(gen)
                    acc = 0
                    while acc < len(draft) and at + acc < n and draft[acc] == truth[at + acc]:
                        acc += 1
                    sizes[len(draft) + 1] += 1
                    cost_sum += cost[len(draft)]
                    tot["drafted"] += len(draft)
                    tot["accepted"] += acc
                    tot[f"drafted_m{dec.matched}"] += len(draft)
                    tot[f"accepted_m{dec.matched}"] += acc
                    if acc < len(draft):
                        fails[(dec.matched, "none" if acc == 0 else "some")] += 1
                    dec.verified(len(draft), acc)
                    for t in truth[at : at + acc + 1]:
                        gen.append(t)
                        dec.push(t)
            label = "warm-up" if run < 0 else f"run {run}"
            print(
                f"{key} {label}: accepted/drafted {tot['accepted']}/{tot['drafted']} "
                f"passes {sum(sizes.values())} by size {dict(sorted(sizes.items()))} "
                f"predicted speedup {plain_steps / cost_sum:.2f}x"
            )
            if verbose and run == runs - 1:
                for m in range(0, 9):
                    if tot[f"drafted_m{m}"]:
                        print(f"   match {m}: {tot[f'accepted_m{m}']}/{tot[f'drafted_m{m}']}")
                print("   rejected drafts (match, accepted any):", dict(fails.most_common()))
                print("   acceptance table:", {k: round(a / t, 2) for k, (a, t) in counts.items()})
        tok.model.close()


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
    replay(json.loads(Path(args.data).read_text()), costs, args.runs, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
