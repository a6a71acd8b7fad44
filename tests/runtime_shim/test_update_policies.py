"""The open policies against a real ``edgepack serve``: ``local`` never touches the
network, ``local_then_update`` serves the installed model while a background update
lands for the next open, ``latest`` opens the newest or raises."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tuf")
pytest.importorskip("fastapi")

import test_update_client as client
from test_update_client import active_bytes, make_pkg, publish_and_wait, updater

from edgepack.runtime_shim.update import (
    DownloadError,
    NotInstalledError,
    UpdateConfig,
    UpdateResult,
    open_slot,
    open_with_policy,
)

pytestmark = client.pytestmark
world = client.world  # the real server's fixtures, shared
fresh = client.fresh
DEAD_SERVER = "http://127.0.0.1:9"  # the discard port: nothing listens on loopback


def version_of(model: Any) -> str:
    return model.package.header.identity.version


class Delivered:
    """The updater's ``on_completed`` / ``on_failed`` callbacks, remembered."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.completed: list[UpdateResult] = []
        self.failed: list[UpdateResult] = []

    def callbacks(self) -> dict[str, Any]:
        return {"on_completed": self._on(self.completed), "on_failed": self._on(self.failed)}

    def _on(self, into: list[UpdateResult]):
        def record(result: UpdateResult) -> None:
            into.append(result)
            self.done.set()

        return record

    def wait(self) -> None:
        assert self.done.wait(120), "the background update never reported"


@pytest.mark.parametrize("policy", ["local", "local_then_update"])
def test_local_policies_with_nothing_installed_say_to_update_first(
    tmp_path: Path, policy: str
) -> None:
    u = None if policy == "local" else updater({"url": DEAD_SERVER, "root": b"{}"}, tmp_path)
    with pytest.raises(NotInstalledError, match="update first"):
        open_with_policy(tmp_path, policy, u)


def test_local_opens_the_installed_model_without_the_network(fresh: dict[str, Any]) -> None:
    publish_and_wait(fresh, fresh["v2"])
    requests = len(fresh["server"].access_lines())
    with open_with_policy(fresh["slots"], "local", threads=1) as model:
        assert version_of(model) == "1.0.0"
        assert np.isfinite(model.logits([1, 2])).all()
    assert len(fresh["server"].access_lines()) == requests  # not one request
    assert active_bytes(fresh["slots"]) == fresh["v1"].read_bytes()


def test_local_then_update_serves_v1_and_the_next_open_gets_v2(fresh: dict[str, Any]) -> None:
    publish_and_wait(fresh, fresh["v2"])
    seen = Delivered()
    u = updater(fresh, fresh["slots"], **seen.callbacks())
    with open_with_policy(fresh["slots"], "local_then_update", u, threads=1) as model:
        assert version_of(model) == "1.0.0"
        seen.wait()
        assert not seen.failed and [r.result for r in seen.completed] == ["updated"]
        assert seen.completed[0].version == "1.1.0"
        assert np.isfinite(model.logits([1, 2])).all()  # the open model keeps serving
    assert active_bytes(fresh["slots"]) == fresh["v2"].read_bytes()
    with open_slot(fresh["slots"], threads=1) as model:
        assert version_of(model) == "1.1.0"


def test_local_then_update_delivers_a_failure_to_on_failed(fresh: dict[str, Any]) -> None:
    seen = Delivered()
    cfg = UpdateConfig(read_timeout=2, max_attempts=1)
    u = updater({**fresh, "url": DEAD_SERVER}, fresh["slots"], config=cfg, **seen.callbacks())
    with open_with_policy(fresh["slots"], "local_then_update", u, threads=1) as model:
        assert version_of(model) == "1.0.0"
        seen.wait()
    assert not seen.completed and [r.result for r in seen.failed] == ["failed"]
    assert active_bytes(fresh["slots"]) == fresh["v1"].read_bytes()


def test_latest_installs_on_first_use(world: dict[str, Any], tmp_path: Path) -> None:
    u = updater(world, tmp_path / "slots")
    with open_with_policy(tmp_path / "slots", "latest", u, threads=1) as model:
        assert np.isfinite(model.logits([1, 2])).all()
    assert u.last_error is None


def test_latest_waits_for_the_newest(fresh: dict[str, Any]) -> None:
    publish_and_wait(fresh, fresh["v2"])
    u = updater(fresh, fresh["slots"])
    with open_with_policy(fresh["slots"], "latest", u, threads=1) as model:
        assert version_of(model) == "1.1.0"
    assert active_bytes(fresh["slots"]) == fresh["v2"].read_bytes()


def test_one_updater_serves_many_runs(fresh: dict[str, Any]) -> None:
    """An app keeps one updater: each run starts clean (no download of the last run)."""
    seen = Delivered()
    u = updater(fresh, fresh["slots"], **seen.callbacks())
    for pkg in (fresh["v2"], make_pkg(fresh["slots"].parent, "1.2.0")):
        publish_and_wait(fresh, pkg)
        with open_with_policy(fresh["slots"], "latest", u, threads=1):
            pass
        run = seen.completed[-1]
        assert run.result == "updated" and run.plan == "delta", run
        assert not run.fell_back_to_full and 0 < run.bytes_downloaded < run.full_bytes // 10
        assert u.check_and_apply().bytes_downloaded == 0
    assert not seen.failed and active_bytes(fresh["slots"]) == pkg.read_bytes()


def test_latest_raises_when_the_update_fails(fresh: dict[str, Any]) -> None:
    cfg = UpdateConfig(read_timeout=2, max_attempts=1)
    u = updater({**fresh, "url": DEAD_SERVER}, fresh["slots"], config=cfg)
    with pytest.raises(DownloadError):
        open_with_policy(fresh["slots"], "latest", u)
    assert active_bytes(fresh["slots"]) == fresh["v1"].read_bytes()


def test_unknown_policy_or_missing_updater_is_misuse(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown update policy"):
        open_with_policy(tmp_path, "eventually")
    with pytest.raises(ValueError, match="needs an updater"):
        open_with_policy(tmp_path, "latest")
