"""kill -9 of the update client at 60 seeded random crash points (download, staging,
switch, health check): after each the active slot opens and verifies, the next run
completes the update, and a kill mid-download costs at most one chunk again.
bench/crash.py runs 1,000."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tuf")
pytest.importorskip("fastapi")

from crashtrial import CrashWorld

from edgepack.server.releases import deltas as deltas_mod


@pytest.mark.slow
@pytest.mark.skipif(not deltas_mod.delta_codec_available(), reason="needs the delta codec")
def test_kill_at_60_seeded_points_then_the_next_run_completes(tmp_path: Path) -> None:
    world = CrashWorld(tmp_path)
    try:
        assert {"download", "staging", "switched", "health-checked"} <= set(
            world.points["full"] + world.points["delta"]
        )
        summary = world.run(60, seed=13)
    finally:
        world.close()
    assert summary.killed == summary.completed == 60
    assert summary.refetched_after_download_kill, "no trial killed the download"
    assert max(summary.refetched_after_download_kill) <= 1024 * 1024
