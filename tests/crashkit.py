"""Kill an `edgepack` subprocess at a chosen point, and look for what it left behind.

Shared by the crash tests (tests/server/test_releases_crash.py, tests/cli/test_crash_cli.py)
and bench/crash_cli.py. A kill point is one of:

* ``delay:S`` - SIGKILL after S seconds;
* ``log:TEXT`` - SIGKILL a few milliseconds after a stderr line containing TEXT (``-v``
  logging names the steps);
* ``file:GLOB`` - SIGKILL as soon as a file matching GLOB appears in the watched
  directory (a temporary being written: the window a log line cannot reach).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TEMPORARY_PATTERNS", "kill_at", "run_cli", "temporaries"]

# names the writers give their temporaries and scratch directories (format/output_file.py,
# server/store/local.py)
TEMPORARY_PATTERNS = (".*.partial", ".*.verify", ".tmp*")
_POLL = 0.002


def run_cli(
    args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 300
) -> tuple[int, list[str]]:
    """Run ``edgepack ARGS`` to completion; (exit code, stderr lines)."""
    r = subprocess.run(**_popen_args(args, env), timeout=timeout)
    return r.returncode, r.stderr.splitlines(keepends=True)


def kill_at(
    args: Sequence[str],
    point: str,
    rng: random.Random,
    *,
    env: Mapping[str, str] | None = None,
    watch: Path | None = None,
    timeout: float = 120,
) -> tuple[int | None, list[str]]:
    """Run ``edgepack ARGS`` and SIGKILL it at ``point``; (exit code or None when killed,
    stderr lines). A process that finishes before the point is reached is not killed."""
    proc = subprocess.Popen(**_popen_args(args, env))
    kind, _, what = point.partition(":")
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if kind == "log" and what in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    if kind == "delay":
        time.sleep(float(what))
    elif kind == "log":
        while not seen.wait(_POLL) and proc.poll() is None and time.monotonic() < deadline:
            pass
        time.sleep(rng.uniform(0, 0.004))
    elif kind == "file":
        assert watch is not None, "a file: point needs a watched directory"
        while proc.poll() is None and time.monotonic() < deadline:
            if any(watch.glob(what)):
                break
            time.sleep(_POLL)
        time.sleep(rng.uniform(0, 0.01))
    else:
        raise ValueError(f"unknown kill point {point!r}")
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    rc = proc.wait(timeout=30)
    reader.join(timeout=10)
    return (None if rc == -signal.SIGKILL else rc), lines


def _popen_args(args: Sequence[str], env: Mapping[str, str] | None) -> dict[str, Any]:
    return {
        "args": [sys.executable, "-m", "edgepack.cli", *args],
        "stdout": subprocess.DEVNULL,
        "stderr": subprocess.PIPE,
        "text": True,
        "env": dict(env) if env is not None else None,
    }


def temporaries(root: Path) -> list[Path]:
    """Every writer temporary under ``root`` (hidden names included)."""
    found: set[Path] = set()
    for pattern in TEMPORARY_PATTERNS:
        found.update(root.rglob(pattern))
    return sorted(found)
