"""The device client installs ``adapter`` plans from a real ``edgepack serve``: a device on
base B gets only the adapter-only package bound to B, ends with it usable on B, is not
offered it again, and a kill -9 at any crash point of the install leaves B serving and
the next run finishing the install."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from adapterfactory import write_peft
from pkgfactory import make_key
from runtime_fixtures import tiny_spec
from serveproc import ServeProcess

pytest.importorskip("tuf")
pytest.importorskip("fastapi")

from edgepack.packager.adapters import pack_adapter
from edgepack.packager.convert import convert
from edgepack.packager.importers.synthetic import write_hf_llama
from edgepack.runtime_shim.update import UpdateConfig, Updater, open_slot, slot_adapters
from edgepack.runtime_shim.update.crashpoints import CRASH_AT_ENV, CRASH_COUNT_ENV
from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import open_store

IDS = [5, 17, 42, 99, 3, 250, 7, 64]
_CHILD = """
import json, sys
from edgepack.runtime_shim.update import UpdateConfig, Updater
url, slots, root = sys.argv[1:4]
u = Updater(url, slots, root, UpdateConfig(read_bytes=4096), device_id="device-9",
            channel="beta", model="tiny")
print(json.dumps(u.check_and_apply().to_json()))
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """tiny 1.0.0 and an adapter-only 1.0.1 bound to it, both on beta, served; a slot
    directory with 1.0.0 installed."""
    tmp = tmp_path_factory.mktemp("adapter-plan")
    store = tmp / "store"
    repo = ReleaseRepository(open_store(store), KeyRing(tmp / "keys"))
    repo.init()
    src = tmp / "hf"
    write_hf_llama(src, tiny_spec())
    base = tmp / "tiny-1.0.0.epk"
    convert(src, base, encoding="int8", model_version="1.0.0", signing_keys=[make_key(0)])
    peft = write_peft(tmp / "peft", tiny_spec(), targets=("q_proj", "v_proj"))
    adapter = pack_adapter(
        base, peft, tmp / "tiny-1.0.1.epk", version="1.0.1", signing_keys=[make_key(0)]
    )
    repo.publish(base, "beta", model="tiny")
    root = tmp / "root.json"
    root.write_bytes((store / "metadata" / "1.root.json").read_bytes())
    server = ServeProcess(store, tmp / "server.log", "--refresh-seconds", "0.2")
    url = f"http://127.0.0.1:{server.port}"
    on_base = tmp / "on-base"
    first = _updater(url, root, on_base).check_and_apply()
    assert first.result == "updated" and first.plan == "full", first
    repo.publish(adapter, "beta", model="tiny")
    for pkg in (base, adapter):  # gamma: for the test that publishes a release after them
        repo.publish(pkg, "gamma", model="tiny")
    server.stop()  # restart: no waiting for the view to refresh
    server = ServeProcess(store, tmp / "server.log", "--refresh-seconds", "0.2")
    url = f"http://127.0.0.1:{server.port}"
    try:
        yield {"tmp": tmp, "url": url, "root": root, "base": base, "adapter": adapter,
               "on_base": on_base, "repo": repo}  # fmt: skip
    finally:
        server.stop()


def _updater(url: str, root: Path, slots: Path, channel: str = "beta") -> Updater:
    return Updater(url, slots, root, UpdateConfig(read_bytes=4096), device_id="device-9",
                   channel=channel, model="tiny")  # fmt: skip


def _copy(world: dict[str, Any], name: str) -> Path:
    slots = world["tmp"] / "trials" / name
    shutil.rmtree(slots, ignore_errors=True)
    shutil.copytree(world["on_base"], slots)
    return slots


def _adapted_logits(slots: Path) -> tuple[np.ndarray, np.ndarray]:
    (path,) = slot_adapters(slots)
    with open_slot(slots, threads=1, verify="full") as m:
        handle = m.load_adapter(path)
        with m.session(adapter=handle) as s:
            return s.logits(IDS), m.logits(IDS)


def test_a_device_on_the_base_installs_the_adapter_and_can_use_it(world: dict[str, Any]) -> None:
    slots = _copy(world, "install")
    before = (slots / "a" / "model.epk").read_bytes()
    u = _updater(world["url"], world["root"], slots)
    check = u.check()
    assert check.plan == "adapter" and check.adapter.length == world["adapter"].stat().st_size
    result = u.check_and_apply()
    assert result.result == "updated" and result.plan == "adapter", result
    assert result.version == "1.0.0"  # the base stays
    assert 0 < result.bytes_downloaded == world["adapter"].stat().st_size
    assert result.bytes_downloaded < world["base"].stat().st_size / 4
    (path,) = slot_adapters(slots)
    assert path.read_bytes() == world["adapter"].read_bytes()
    journal = json.loads((slots / "journal.json").read_text())
    assert journal["state"] == "healthy" and journal["active"] == "a"
    assert (slots / "a" / "model.epk").read_bytes() == before
    adapted, plain = _adapted_logits(slots)
    assert np.isfinite(adapted).all() and not np.array_equal(adapted, plain)
    again = _updater(world["url"], world["root"], slots).check_and_apply()
    assert again.result == "up_to_date", again  # it says it has the adapter


def test_an_adapter_for_another_base_is_refused_and_not_installed(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """The health check loads the adapter on the slot's model: bound to other weights,
    it is refused, remembered as bad and never renamed into the slot."""
    slots = _copy(world, "wrong-base")
    u = _updater(world["url"], world["root"], slots)
    check = u.check()
    assert check.plan == "adapter"
    other = tmp_path / "other"
    write_hf_llama(other, tiny_spec(), extra={
        "model.layers.0.self_attn.q_proj.weight": np.full((128, 128), 0.01, np.float32)})
    other_pkg = tmp_path / "other.epk"
    convert(other, other_pkg, encoding="int8", model_version="1.0.0")
    shutil.copyfile(other_pkg, slots / "a" / "model.epk")  # the slot now holds other weights
    result = u.apply()
    assert result.result == "rolled_back" and "AdapterBaseError" in result.reason, result
    assert slot_adapters(slots) == []
    journal = json.loads((slots / "journal.json").read_text())
    assert check.adapter.sha256 in journal["bad_sha256"]


def test_adapters_stay_installed_across_a_release_with_the_same_weights(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """A release that changes no weight (here only the version) keeps the adapters bound:
    they move to the new slot with it and stay usable."""
    from edgepack.format.resign import resign

    slots = tmp_path / "gamma"
    run = lambda: _updater(world["url"], world["root"], slots, "gamma").check_and_apply()  # noqa: E731
    assert run().plan == "full"
    assert run().plan == "adapter" and len(slot_adapters(slots)) == 1
    newer = tmp_path / "tiny-1.1.0.epk"
    resign(world["base"], newer, signing_keys=[make_key(0)], version="1.1.0")
    world["repo"].publish(newer, "gamma", model="tiny")
    time.sleep(0.6)  # the server's view refreshes every 0.2 s
    result = run()
    assert result.result == "updated" and result.version == "1.1.0", result
    assert json.loads((slots / "journal.json").read_text())["active"] == "b"
    (path,) = slot_adapters(slots)
    assert path.parent == slots / "b" / "adapters"
    adapted, plain = _adapted_logits(slots)
    assert np.isfinite(adapted).all() and not np.array_equal(adapted, plain)
    assert run().result == "up_to_date"


def _child(world: dict[str, Any], slots: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", _CHILD, world["url"], str(slots), str(world["root"])]
    return subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.slow
def test_kill_at_every_crash_point_of_an_adapter_install(world: dict[str, Any]) -> None:
    log = world["tmp"] / "adapter-points.txt"
    out = _child(world, _copy(world, "count"), {CRASH_COUNT_ENV: str(log)})
    assert out.returncode == 0 and json.loads(out.stdout)["plan"] == "adapter", out.stderr
    labels = [line.split(" ", 1)[1] for line in log.read_text().splitlines()]
    assert {"download", "staging", "staging-written", "staging-replaced"} <= set(labels)
    base = (world["on_base"] / "a" / "model.epk").read_bytes()
    for at in range(1, len(labels) + 1):
        slots = _copy(world, f"kill-{at}")
        killed = _child(world, slots, {CRASH_AT_ENV: str(at)})
        assert killed.returncode == -9, (at, labels[at - 1], killed.stderr[-2000:])
        with open_slot(slots, threads=1, verify="full") as m:  # the base still serves
            assert m.package.path.read_bytes() == base
        for p in slot_adapters(slots):  # nothing half-written under an installed name
            assert p.read_bytes() == world["adapter"].read_bytes()
        result = _updater(world["url"], world["root"], slots).check_and_apply()
        assert result.result in ("updated", "up_to_date"), (at, labels[at - 1], result)
        adapted, _plain = _adapted_logits(slots)
        assert np.isfinite(adapted).all()


class _Info:
    def __init__(self, length: int, sha: str) -> None:
        self.length, self.hashes, self.custom = length, {"sha256": sha}, {}


def _answer(*targets: dict[str, Any]) -> dict[str, Any]:
    return {"plan": "adapter", "release": "1.0.1", "reason": "", "targets": list(targets)}


def _target(kind: str = "adapter", signed: bool = True) -> dict[str, Any]:
    return {"path": f"tiny/beta/{kind}.epk", "length": 10, "sha256": "a" * 64, "kind": kind,
            "signed": signed}  # fmt: skip


def test_an_adapter_plan_is_checked_against_the_signed_targets() -> None:
    from edgepack.runtime_shim.update import MetadataError, UnsafeTargetError
    from edgepack.runtime_shim.update.plan import verify_plan

    signed = lambda path: _Info(10, "a" * 64)  # noqa: E731
    ok = verify_plan(_answer(_target()), signed, UpdateConfig(), "1.0.0", "b" * 64)
    assert ok.plan == "adapter" and ok.installs == ok.adapter and ok.package is None
    assert ok.download_bytes == 10
    # "signed": false does not exempt an adapter from the signed targets
    with pytest.raises(UnsafeTargetError):
        verify_plan(_answer(_target(signed=False)), lambda p: None, UpdateConfig(), None, None)
    with pytest.raises(UnsafeTargetError):
        verify_plan(_answer(_target()), lambda p: _Info(10, "c" * 64), UpdateConfig(), None, None)
    for bad in (_answer(_target("package")), _answer(_target(), _target("delta"))):
        with pytest.raises(MetadataError):
            verify_plan(bad, signed, UpdateConfig(), None, None)
