"""SIGKILL during `patch`, `convert`, `publish` and `build` (issue 11's crash-harness bar,
a few seeded trials; bench/crash_cli.py runs many): no partial file under a final name,
no stale temporary after the next run, `repo verify --deep` OK."""

from __future__ import annotations

from pathlib import Path

import pytest
from crashcli import COMMANDS, Trials

TRIALS = 4  # per command: two at steps, two at random delays


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_killed_commands_leave_nothing_torn_or_stale(tmp_path: Path, command: str) -> None:
    outcomes = Trials(tmp_path, seed=11).run(TRIALS, (command,))
    assert sum(outcomes.values()) == TRIALS
    assert any("killed" in outcome for outcome in outcomes), outcomes
