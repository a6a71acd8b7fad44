"""The GIL check the kernel tests rely on tells a releasing call from a holding one."""

from __future__ import annotations

import time

from gilcheck import runs_python_during


def test_a_call_holding_the_gil_never_overlaps() -> None:
    assert not runs_python_during(lambda: sum(range(200_000)), tries=5)


def test_a_call_releasing_the_gil_overlaps() -> None:
    assert runs_python_during(lambda: time.sleep(0.05))
