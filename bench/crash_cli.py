"""Crash harness (issue 11 bar): SIGKILL `patch`, `convert` and `publish` at every logged
step and at random points, many times each, and count the outcomes.

Every trial checks that no partial file sits under a final name, that the next run of
the same command succeeds and leaves no stale temporary, and (publish) that
`repo verify --deep` is OK; the first broken invariant stops the run with its story.
The trials are tests/crashcli.py's, which tests/cli/test_crash_cli.py runs a few of.

    python bench/crash_cli.py [--trials 200] [--seed 1] [--commands patch,convert,publish]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from crashcli import COMMANDS, Trials


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200, help="Kills per command.")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--commands", default=",".join(COMMANDS))
    args = ap.parse_args()
    commands = tuple(c for c in args.commands.split(",") if c)
    unknown = set(commands) - set(COMMANDS)
    if unknown:
        ap.error(f"unknown command(s): {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="edgepack-crash-") as work:
        outcomes = Trials(Path(work), args.seed).run(args.trials, commands)
    for outcome, count in sorted(outcomes.items()):
        print(f"{count:6d}  {outcome}")
    print(f"{sum(outcomes.values())} trials, every invariant held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
