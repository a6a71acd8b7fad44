"""The device update client against a real ``edgepack serve``: install, delta update,
attacks refused with the active model untouched, kill -9 at seeded points, rollback.

Packages are small pkgfactory llama models padded with a few MB of incompressible
bytes (the same in every version), so a delta is tiny and the full package is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import numpy as np
from pkgfactory import make_key
from runtime_fixtures import tiny_spec
from serveproc import ServeProcess

pytest.importorskip("tuf")
pytest.importorskip("fastapi")

from edgepack.runtime_shim.update import (  # noqa: E402
    MetadataSignatureError,
    RollbackError,
    TargetVerificationError,
    UpdateConfig,
    Updater,
    open_slot,
)
from edgepack.packager.convert import convert  # noqa: E402
from edgepack.packager.importers.synthetic import write_hf_llama  # noqa: E402
from edgepack.server.releases import deltas as deltas_mod  # noqa: E402
from edgepack.server.releases.keys import KeyRing  # noqa: E402
from edgepack.server.releases.repository import ReleaseRepository  # noqa: E402
from edgepack.server.store import open_store  # noqa: E402

pytestmark = pytest.mark.skipif(
    not deltas_mod.delta_codec_available(), reason="needs the delta codec"
)


def make_pkg(tmp: Path, version: str, **weights: np.ndarray) -> Path:
    """The tiny llama of tests/runtime_fixtures at ``version``, ``weights`` replaced."""
    src = tmp / f"hf-{version}"
    write_hf_llama(src, tiny_spec(), extra=weights)
    out = tmp / f"tiny-{version}.epk"
    convert(src, out, encoding="int8", model_version=version, signing_keys=[make_key(0)])
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """tiny 1.0.0 published on beta and served; 1.1.0 built, published by the tests."""
    tmp = tmp_path_factory.mktemp("client")
    store = tmp / "store"
    repo = ReleaseRepository(open_store(store), KeyRing(tmp / "keys"))
    repo.init()
    v1 = make_pkg(tmp, "1.0.0")
    v2 = make_pkg(tmp, "1.1.0")
    repo.publish(v1, "beta", model="tiny")
    server = ServeProcess(store, tmp / "server.log", "--refresh-seconds", "0.2")
    root = (store / "metadata" / "1.root.json").read_bytes()
    try:
        yield {"tmp": tmp, "store": store, "repo": repo, "v1": v1, "v2": v2,
               "server": server, "url": f"http://127.0.0.1:{server.port}", "root": root}
    finally:
        server.stop()


def updater(world: dict[str, Any], slot_dir: Path, **kw: Any) -> Updater:
    cfg = kw.pop("config", UpdateConfig(read_timeout=5, slow_grace=2))
    return Updater(world["url"], slot_dir, world["root"], cfg, device_id="device-7",
                   channel="beta", model="tiny", **kw)


def test_v1_installs_then_v2_arrives_as_a_delta(world: dict[str, Any], tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    r1 = updater(world, slots).check_and_apply()
    assert r1.result == "updated", r1
    assert r1.plan == "full" and r1.version == "1.0.0"
    assert r1.bytes_downloaded == r1.full_bytes == world["v1"].stat().st_size
    with open_slot(slots, threads=1) as m:
        assert m.logits([1, 2, 3]).shape[-1] > 0
    assert updater(world, slots).check_and_apply().result == "up_to_date"

    world["repo"].publish(world["v2"], "beta", model="tiny")
    import time

    time.sleep(0.5)  # the server's view refreshes every 0.2 s
    r2 = updater(world, slots).check_and_apply()
    assert r2.result == "updated", r2
    assert r2.plan == "delta" and r2.version == "1.1.0"
    assert 0 < r2.bytes_downloaded < r2.full_bytes // 10
    active = slots / json.loads((slots / "journal.json").read_text())["active"] / "model.epk"
    assert active.read_bytes() == world["v2"].read_bytes()
    with open_slot(slots, threads=1) as m:
        assert m.logits([1, 2, 3]).shape[-1] > 0


def test_cli_update_prints_the_json_result(world: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "root.json"
    root.write_bytes(world["root"])
    cmd = [sys.executable, "-m", "edgepack.cli", "update", "--server", world["url"],
           "--slot-dir", str(tmp_path / "slots"), "--device-id", "device-9", "--channel", "beta",
           "--trusted-root", str(root), "--model", "tiny", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["result"] == "updated" and result["plan"] == "full"
    assert result["bytes_downloaded"] == result["full_bytes"] > 0
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert json.loads(again.stdout)["result"] == "up_to_date"
