"""Crash harness (issue 11 bar): SIGKILL `patch`, `convert`, `publish` and `build` at every
logged step and at random points, many times each, and count the outcomes.

Every trial checks that no partial file sits under a final name, that the next run of
the same command succeeds and leaves no stale temporary, and (publish) that
`repo verify --deep` is OK; the first broken invariant stops the run with its story.
The trials are tests/crashcli.py's, which tests/cli/test_crash_cli.py runs a few of.
Odd trials kill at a random delay, even ones cycle through the command's steps, so
``--trials 400`` is 200 random points and 200 kills at steps per command.

Trial ``n`` depends on ``(seed, command, n)`` only: ``--jobs`` spreads the trials over
that many processes (each with its own inputs and store), and every finished trial is
appended to ``--state``, so rerunning the same command continues where a stopped run
ended (``--fresh`` starts over).

    python bench/crash_cli.py [--trials 400] [--seed 1] [--jobs 2]
                              [--commands patch,convert,publish,build] [--state FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from crashcli import COMMANDS, Trials

from edgepack.format.output_file import (
    pid_temporary_directory,
    remove_stale_temporary_directories,
)

_WORLDS = "edgepack-crash-cli-"  # the run's folder of worlds: <prefix><pid>-<random>

_trials: Trials | None = None  # one world per worker process


def _init(root: str, seed: int) -> None:
    """A world in its own folder under the run's (removed by the parent: a pool's
    workers are terminated, their own clean-up never runs)."""
    global _trials
    _trials = Trials(Path(tempfile.mkdtemp(dir=root)), seed)


def _run(task: tuple[str, int]) -> tuple[str, int, str, str]:
    """(command, n, outcome, failure story or "")."""
    command, n = task
    assert _trials is not None
    try:
        return command, n, _trials.trial(command, n), ""
    except AssertionError as exc:
        return command, n, "FAILED", str(exc)[-4000:]


def _load(state: Path, seed: int, fresh: bool) -> dict[tuple[str, int], str]:
    done: dict[tuple[str, int], str] = {}
    if fresh or not state.exists():
        state.write_text(json.dumps({"seed": seed}) + "\n")
        return done
    lines = state.read_text().splitlines()
    if json.loads(lines[0]).get("seed") != seed:
        raise SystemExit(f"{state} is a run with another --seed; use --fresh")
    for line in lines[1:]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill of this harness
        if rec["outcome"] != "FAILED":
            done[(rec["command"], rec["n"])] = rec["outcome"]
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=400, help="Kills per command.")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--commands", default=",".join(COMMANDS))
    ap.add_argument("--jobs", type=int, default=1, help="Processes running trials.")
    ap.add_argument("--state", type=Path, default=Path("crash-cli-state.jsonl"))
    ap.add_argument("--fresh", action="store_true", help="Ignore an existing state file.")
    args = ap.parse_args()
    commands = tuple(c for c in args.commands.split(",") if c)
    unknown = set(commands) - set(COMMANDS)
    if unknown:
        ap.error(f"unknown command(s): {', '.join(sorted(unknown))}")
    done = _load(args.state, args.seed, args.fresh)
    # interleaved, so every worker sees every command and the jobs stay balanced
    tasks = [(c, n) for n in range(args.trials) for c in commands if (c, n) not in done]
    print(f"{len(tasks)} trials to run ({len(done)} done before) on {args.jobs} job(s)")
    outcomes = Counter(done.values())
    failure = ""
    began = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    remove_stale_temporary_directories(_WORLDS)  # what a killed run left
    root = pid_temporary_directory(_WORLDS)
    with root, ctx.Pool(max(1, args.jobs), _init, (root.name, args.seed)) as pool, open(
        args.state, "a"
    ) as log:
        for command, n, outcome, story in pool.imap_unordered(_run, tasks):
            log.write(json.dumps({"command": command, "n": n, "outcome": outcome}) + "\n")
            log.flush()
            if story:
                failure = f"{command} trial {n}: {story}"
                pool.terminate()
                break
            outcomes[outcome] += 1
    for outcome, count in sorted(outcomes.items()):
        print(f"{count:6d}  {outcome}")
    ran = sum(outcomes.values()) - len(done)
    print(f"{sum(outcomes.values())} trials, {ran} of them in {time.monotonic() - began:.0f} s")
    if failure:
        print(f"INVARIANT BROKEN: {failure}")
        return 1
    print("every invariant held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
