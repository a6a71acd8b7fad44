"""Fuzz the reader, the runtime and the patcher at scale (issue 11's bar).

    .venv/bin/python bench/fuzz.py [--packages N] [--deltas N] [--workers 2]
                                   [--state fuzz-state.json] [--seed S]

N mutated packages go through ``Package.open`` + reading everything + ``verify`` with
the trusted key + ``runtime_shim.open(...).session().logits(...)`` (one forward pass); N
mutated deltas through ``apply_delta``. Mutant ``i`` is derived from ``(seed, kind, i)``
alone, so a run is reproducible and resumable: finished batches are recorded in the
state file (rerun the same command to continue; ``--fresh`` starts over). Prints the
count by outcome and checks the bar: zero untyped exceptions, zero outputs that differ
from the expected bytes (an accepted package that was not re-signed computes the
original's logits bit for bit; a successful patch writes the new package byte for
byte), peak RSS of every worker under 256 MiB (the mutants are under 16 MiB).

The mutators are the test suite's (tests/format/test_fuzz_package.py,
tests/format/test_delta_fuzz.py); the corpus is built once into ``--work``. Untyped
exceptions raised while the runtime reads the model config or binds tensors are
counted apart ("config:..."), as the runtime's config validation owns them.

What the harness itself costs is kept small so the figures measure the checks: mutants
are built in memory and written to one RAM file per worker (``/dev/shm``, removed at the
end), the workers are one process pool over every core for the whole run, the
original's parsed form is computed once per worker (the mutators re-parse nothing), and
a config mutant's re-encoded, re-signed header is made once per (key, value). Besides
the wall-clock rate, the run prints the workers' CPU time per mutant: on a shared
machine the wall rate follows the load, the CPU cost does not.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import random
import resource
import sys
import time
import traceback
from pathlib import Path

from edgepack.format.output_file import (
    pid_temporary_directory,
    remove_stale_temporary_directories,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "format")]

RSS_LIMIT_MIB = 256
CONFIG_SHARE = 0.1  # package mutants whose (re-signed) model config gets a hostile value
CONFIG_VALUES = ("abc", -1, 0, 0.0, [1], {}, None, True, 31, 10**9, 2**63, 1e-300, 1e300)
CONFIG_CODE = ("runtime_shim/config.py", "runtime_shim/weights.py")  # config values, tensor set
KINDS = ("package", "delta")
_SCRATCH = "edgepack-fuzz-"  # the run's scratch directory: <prefix><pid>-<random>

_worker: dict = {}  # per-process corpus, set by _init


# ------------------------------------------------------------------------ the corpus


def build_corpus(work: Path) -> None:
    """Write the runnable signed package, its logits, and a delta corpus into ``work``."""
    import test_delta_fuzz
    import test_fuzz_package

    if (work / "ready").exists():
        return
    work.mkdir(parents=True, exist_ok=True)
    orig, expected = test_fuzz_package.runnable_original(work, work)
    (work / "package.epk").write_bytes(orig.raw)
    (work / "logits.bin").write_bytes(expected)
    (work / "delta").mkdir(exist_ok=True)
    test_delta_fuzz.build_corpus(work / "delta")
    (work / "ready").write_text("ok")


def _init(work: str, scratch_root: str) -> None:
    import deltafactory
    import numpy as np
    import test_delta_fuzz
    import test_fuzz_package
    from pkgfactory import make_key

    os.fsync = lambda fd: None  # durability is not what is fuzzed (the tests do the same)
    work_path = Path(work)
    scratch = Path(scratch_root) / f"w{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    raw = (work_path / "package.epk").read_bytes()
    orig = test_fuzz_package.make_original(raw, raw, make_key(3), scratch / "mutant.epk")
    delta_dir = work_path / "delta"
    delta = (delta_dir / "d.epkd").read_bytes()
    # every delta mutator starts by parsing the original: parse it once (the parts are
    # immutable), mutants are parsed as they come
    parsed = deltafactory.split_delta(delta)
    split = deltafactory.split_delta

    def split_once(raw: bytes):
        return parsed if raw is delta else split(raw)

    deltafactory.split_delta = test_delta_fuzz.split_delta = split_once
    _worker.update(
        orig=orig,
        logits=(work_path / "logits.bin").read_bytes(),
        old=delta_dir / "old.epk",
        new=(delta_dir / "new.epk").read_bytes(),
        delta=delta,
        scratch=scratch,
        np=np,
        config_mutants={},
        orig_data=orig.raw[orig.data_offset : orig.data_end],
    )


# ------------------------------------------------------------------------ one batch


def _rng_seed(seed: int, kind: str, index: int) -> int:
    return seed * 1_000_003 + KINDS.index(kind) * 1_000_000_007 + index


def _classify(exc: BaseException) -> str:
    """Untyped exception -> 'config:Type' (the runtime's config/binding code) or
    'CRASH:Type@file:line' (the innermost frame of ours)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if str(ROOT) in f.filename and "/tests/" not in f.filename]
    if any(any(c in f.filename for c in CONFIG_CODE) for f in ours):
        return f"config:{type(exc).__name__}: {str(exc)[:70]}"
    where = ours[-1] if ours else frames[-1]
    rel = os.path.relpath(where.filename, ROOT)
    return f"CRASH:{type(exc).__name__}@{rel}:{where.lineno}"


def _config_mutant(orig, rng: random.Random) -> bytes:
    """The model config with one value replaced, re-signed: only the runtime's config
    validation can refuse it."""
    which = rng.choice(range(len(CONFIG_VALUES)))  # the draw rng.choice(CONFIG_VALUES) makes
    key = rng.choice(sorted(orig.header.identity.config))  # after it, as in earlier runs
    return _resigned_config(orig, key, which)


def _resigned_config(orig, key: str, which: int) -> bytes:
    """The mutant for (key, value): encoding and signing a header is most of a mutant's
    cost and there are few such pairs, so each is made once per worker; only its header
    and signature are kept, the original's data region is spliced in each time."""
    from pkgfactory import file_parts

    made = _worker["config_mutants"]
    if (key, which) not in made:
        raw = _encode_config(orig, key, CONFIG_VALUES[which])
        pre = file_parts(raw).preamble
        made[(key, which)] = (raw[: pre.data_offset], raw[pre.data_end :])
    head, tail = made[(key, which)]
    return head + _worker["orig_data"] + tail


def _encode_config(orig, key: str, value: object) -> bytes:
    from dataclasses import replace

    from pkgfactory import replace_header

    identity = orig.header.identity
    cfg = {**identity.config, key: value}
    header = replace(orig.header, identity=replace(identity, config=cfg))
    return replace_header(orig.raw, header, sign_with=orig.key)


def _package_mutant(index: int, seed: int) -> str:
    import test_fuzz_package

    from edgepack.format import EdgepackError

    orig = _worker["orig"]
    rng = random.Random(_rng_seed(seed, "package", index))
    if rng.random() < CONFIG_SHARE:
        orig.path.write_bytes(_config_mutant(orig, rng))
        try:
            outcome, _ = test_fuzz_package.exercise_forward(orig.path, orig.pub, b"")
        except EdgepackError as exc:  # exercise_forward lets only its own stages' through
            return f"config-value:{type(exc).__name__}"
        except Exception as exc:  # the runtime's config validation is to type these
            return f"config-value:untyped {type(exc).__name__}: {str(exc)[:60]}"
        return "config-value:" + ("accepted" if outcome.startswith("accepted") else outcome)
    while True:
        _, (mutant, resigned, _) = test_fuzz_package.random_mutant(orig, rng)
        if mutant != orig.raw:
            break
    orig.path.write_bytes(mutant)
    outcome, _ = test_fuzz_package.exercise_forward(orig.path, orig.pub, _worker["logits"])
    if outcome == "accepted:output-differs" and resigned:
        outcome = "accepted:re-signed, other logits"
    elif outcome == "accepted" and not resigned:
        problem = test_fuzz_package._tamper_check(orig, mutant)
        if problem:
            outcome = "WRONG:accepted a tampered file"
    if outcome == "accepted:output-differs":
        outcome = "WRONG:accepted, other logits"
    return outcome


def _delta_mutant(index: int, seed: int) -> str:
    import test_delta_fuzz

    from edgepack.format import EdgepackError
    from edgepack.format.delta import apply_delta

    np = _worker["np"]
    rng = np.random.default_rng(_rng_seed(seed, "delta", index))
    mutator = test_delta_fuzz.MUTATORS[int(rng.integers(len(test_delta_fuzz.MUTATORS)))]
    bad, target = _worker["scratch"] / "bad.epkd", _worker["scratch"] / "out.epk"
    bad.write_bytes(mutator(_worker["delta"], rng))
    target.write_bytes(b"old release")
    try:
        apply_delta(_worker["old"], bad, target)
    except EdgepackError as exc:
        if target.read_bytes() != b"old release":
            return "WRONG:failed patch changed the target"
        return f"patch:{type(exc).__name__}"
    return "patched" if target.read_bytes() == _worker["new"] else "WRONG:patched other bytes"


def run_batch(task: tuple[str, int, int, int]) -> dict:
    kind, start, count, seed = task
    import numpy as np

    one = _package_mutant if kind == "package" else _delta_mutant
    cpu = time.process_time()
    outcomes: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    for index in range(start, start + count):
        try:
            with np.errstate(all="ignore"):
                outcome = one(index, seed)
        except Exception as exc:
            outcome = _classify(exc)
            examples.setdefault(outcome, f"{kind} #{index}: {traceback.format_exc()[-1500:]}")
        if outcome.startswith("WRONG") and outcome not in examples:
            examples[outcome] = f"{kind} #{index}"
        outcomes[outcome] += 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "kind": kind,
        "start": start,
        "outcomes": dict(outcomes),
        "examples": examples,
        "peak_mib": peak,
        "hwm_mib": _vm_hwm_mib(),
        "cpu_seconds": time.process_time() - cpu,
    }


def _vm_hwm_mib() -> float:
    """This process's own peak RSS (ru_maxrss also counts a parent's, over fork/exec)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# ------------------------------------------------------------------------ the run


def _load_state(path: Path, args: argparse.Namespace) -> dict:
    fresh = {
        "seed": args.seed,
        "batch": args.batch,
        "done": {k: [] for k in KINDS},
        "outcomes": {k: {} for k in KINDS},
        "examples": {},
        "peak_mib": 0.0,
        "hwm_mib": 0.0,
        "seconds": 0.0,
        "cpu_seconds": {k: 0.0 for k in KINDS},
    }
    if args.fresh or not path.exists():
        return fresh
    state = json.loads(path.read_text())
    if (state["seed"], state["batch"]) != (args.seed, args.batch):
        raise SystemExit(f"{path} is a run with another --seed/--batch; use --fresh")
    state.setdefault("cpu_seconds", fresh["cpu_seconds"])  # a state file of an older run
    return state


def _save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _report(state: dict, totals: dict[str, int]) -> bool:
    ok = True
    seconds = max(state["seconds"], 1e-9)
    for kind in KINDS:
        outcomes = state["outcomes"][kind]
        n = sum(outcomes.values())
        cpu_ms = 1e3 * state["cpu_seconds"][kind] / max(n, 1)
        print(
            f"{kind}s: {n} of {totals[kind]} ({n / seconds:.0f}/s over the whole run, "
            f"{cpu_ms:.2f} ms of worker CPU each)"
        )
        for outcome, count in sorted(outcomes.items(), key=lambda kv: -kv[1]):
            print(f"  {count:>9}  {outcome}")
    outcomes = [(o, c) for k in KINDS for o, c in state["outcomes"][k].items()]
    config = sum(c for o, c in outcomes if o.startswith(("config:", "config-value:untyped")))
    bad = [(o, c) for o, c in outcomes if o.startswith(("CRASH", "WRONG"))]
    print(f"untyped exceptions / wrong outputs: {sum(c for _, c in bad)}")
    print(f"untyped exceptions in the runtime's config/binding code (not gated): {config}")
    print(
        f"peak RSS per worker: {state['peak_mib']:.0f} MiB (getrusage), "
        f"{state['hwm_mib']:.0f} MiB (VmHWM); limit {RSS_LIMIT_MIB} MiB"
    )
    for outcome, example in sorted(state["examples"].items()):
        print(f"--- {outcome}\n{example}")
    if bad or max(state["peak_mib"], state["hwm_mib"]) >= RSS_LIMIT_MIB:
        ok = False
    print("BAR:", "met" if ok else "NOT met")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packages", type=int, default=1_000_000)
    ap.add_argument("--deltas", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--batch", type=int, default=200, help="mutants per task")
    ap.add_argument("--seed", type=int, default=0xED6E)
    ap.add_argument("--state", type=Path, default=Path("fuzz-state.json"))
    ap.add_argument("--work", type=Path, default=Path("fuzz-work"), help="corpus folder")
    ap.add_argument("--fresh", action="store_true", help="ignore an existing state file")
    args = ap.parse_args()

    ctx = multiprocessing.get_context("spawn")  # workers' RSS is theirs, not a fork's copy
    with ctx.Pool(1) as setup:  # building the corpus imports far more than fuzzing needs
        setup.apply(build_corpus, (args.work,))
    state = _load_state(args.state, args)
    totals = {"package": args.packages, "delta": args.deltas}
    done = {k: set(state["done"][k]) for k in KINDS}
    tasks = []
    for start in range(0, max(totals.values()), args.batch):  # interleave the two kinds
        for kind in KINDS:
            if start < totals[kind] and start not in done[kind]:
                tasks.append((kind, start, min(args.batch, totals[kind] - start), args.seed))
    print(f"{len(tasks)} batches of {args.batch} to run on {args.workers} workers")
    shm = Path("/dev/shm")
    ram = shm if os.access(shm, os.W_OK) else args.work  # the mutants' files: RAM if any
    remove_stale_temporary_directories(_SCRATCH, ram)  # what a killed run left
    with pid_temporary_directory(_SCRATCH, ram) as scratch:
        _run(ctx, args, tasks, state, scratch)
    return 0 if _report(state, totals) else 1


def _run(ctx, args: argparse.Namespace, tasks: list, state: dict, scratch: str) -> None:
    began, last_print = time.perf_counter(), 0.0
    base_seconds = state["seconds"]
    init = (str(args.work), scratch)
    with ctx.Pool(args.workers, initializer=_init, initargs=init) as pool:
        for result in pool.imap_unordered(run_batch, tasks):
            kind = result["kind"]
            counter = collections.Counter(state["outcomes"][kind])
            counter.update(result["outcomes"])
            state["outcomes"][kind] = dict(counter)
            state["done"][kind].append(result["start"])
            for outcome, example in result["examples"].items():
                state["examples"].setdefault(outcome, example)
            state["peak_mib"] = max(state["peak_mib"], result["peak_mib"])
            state["hwm_mib"] = max(state["hwm_mib"], result["hwm_mib"])
            state["cpu_seconds"][kind] += result["cpu_seconds"]
            state["seconds"] = base_seconds + time.perf_counter() - began
            _save_state(args.state, state)
            if time.perf_counter() - last_print > 30:
                last_print = time.perf_counter()
                done = {k: sum(state["outcomes"][k].values()) for k in KINDS}
                print(f"  {state['seconds']:.0f} s: {done}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
