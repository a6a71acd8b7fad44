"""pid-named scratch directories outside the system's temporary directory (the fuzzer's
in /dev/shm): a dead writer's is cleared, a live one's kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from edgepack.format.output_file import (
    pid_temporary_directory,
    remove_stale_temporary_directories,
)


def test_scratch_directories_in_a_given_root(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = tmp_path / f"edgepack-x-{proc.pid}-abc"
    dead.mkdir()
    with pid_temporary_directory("edgepack-x-", tmp_path) as live:
        assert Path(live).parent == tmp_path
        assert remove_stale_temporary_directories("edgepack-x-", tmp_path) == [dead]
        assert Path(live).is_dir() and not dead.exists()
    assert list(tmp_path.iterdir()) == []
