"""The staleness rule for output temporaries (format/output_file.py): a temporary whose
writer pid is dead, or a pid-less one older than an hour, goes; a live writer's, a
young one and another target's stay."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
from pkgfactory import build_package

from edgepack.format.output_file import (
    STALE_AGE_SECONDS,
    create_partial,
    pid_is_running,
    pid_temporary_directory,
    remove_stale_partials,
    remove_stale_temporary_directories,
)

DEAD_PID = 2**22 + 4321  # above the default pid_max


def test_rule(tmp_path: Path) -> None:
    out = tmp_path / "model.epk"
    dead = tmp_path / f".model.epk.{DEAD_PID}-0a1b2c.partial"
    live = tmp_path / f".model.epk.{os.getpid()}-0a1b2c.partial"
    old_no_pid = tmp_path / ".model.epk.ab_cd123.partial"
    young_no_pid = tmp_path / ".model.epk.zz_cd123.partial"
    other_target = tmp_path / f".model.epk.bak.{DEAD_PID}-0a1b2c.partial.x"
    for p in (dead, live, old_no_pid, young_no_pid, other_target):
        p.write_bytes(b"x")
    then = time.time() - STALE_AGE_SECONDS - 60
    os.utime(old_no_pid, (then, then))
    assert sorted(remove_stale_partials(out)) == sorted([dead, old_no_pid])
    assert live.exists() and young_no_pid.exists() and other_target.exists()
    assert pid_is_running(os.getpid()) and not pid_is_running(DEAD_PID)


def test_a_writer_clears_what_a_killed_writer_of_the_same_path_left(tmp_path: Path) -> None:
    out = tmp_path / "p.epk"
    fd, tmp = create_partial(out)
    os.close(fd)
    os.rename(tmp, tmp.with_name(f".p.epk.{DEAD_PID}-ffff.partial"))  # "killed"
    build_package(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.epk"]


def test_scratch_directories_of_dead_writers_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"edgepack-publish-{DEAD_PID}-abc"
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "delta.epkd").write_bytes(b"x" * 100)
    other = tmp_path / f"edgepack-promote-{DEAD_PID}-abc"
    other.mkdir()
    with pid_temporary_directory("edgepack-publish-") as live:
        assert remove_stale_temporary_directories("edgepack-publish-") == [dead]
        assert Path(live).is_dir() and other.is_dir() and not dead.exists()


def test_a_killed_diffs_scratch_directory_goes_with_the_next_diff(tmp_path: Path) -> None:
    from deltafactory import write_release_pair

    scratch = tmp_path / f".d.epkd.{DEAD_PID}-abc_1234.verify"
    scratch.mkdir()
    (scratch / "target.epk").write_bytes(b"half a package")
    write_release_pair(tmp_path, seed=3)  # writes d.epkd, verifying it in a scratch dir
    assert not scratch.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.epkd", "new.epk", "old.epk"]
