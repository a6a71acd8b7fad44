"""Test hook for crash-consistency tests: ``EDGEPACK_UPDATE_CRASH_AT=N`` kills the
process with SIGKILL at the N-th crash point (1-based), as a power cut would stop it
(no cleanup, no ``finally``). ``EDGEPACK_UPDATE_CRASH_COUNT=FILE`` appends one line per
point passed, so a test can learn how many there are. Unset, a point costs one lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["crash_point"]

CRASH_AT_ENV = "EDGEPACK_UPDATE_CRASH_AT"
CRASH_COUNT_ENV = "EDGEPACK_UPDATE_CRASH_COUNT"
_passed = 0


def crash_point(label: str) -> None:
    global _passed
    at = os.environ.get(CRASH_AT_ENV)
    log = os.environ.get(CRASH_COUNT_ENV)
    if at is None and log is None:
        return
    _passed += 1
    if log is not None:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{_passed} {label}\n")
    if at is not None and _passed == int(at):
        os.kill(os.getpid(), signal.SIGKILL)
