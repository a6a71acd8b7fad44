"""Crash consistency of the update client at scale: kill -9 at N seeded random crash
points (default 1,000) across download, staging, switch and health check, against a
real `edgepack serve` on loopback; after each kill the active slot must open and
verify and the next run complete the update. Prints a JSON summary (kills per crash
point, bytes fetched again after a kill mid-download).

    .venv/bin/python bench/crash.py --trials 1000 --seed 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the package factories and the trial helper

from crashtrial import CrashWorld  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgepack-crash-") as tmp:
        world = CrashWorld(Path(tmp))
        try:
            summary = world.run(args.trials, args.seed)
        finally:
            world.close()
    print(json.dumps({"seed": args.seed, **summary.to_json()}, indent=1))


if __name__ == "__main__":
    main()
