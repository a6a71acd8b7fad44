"""On-demand deltas in one process: the store lease, and a delta that names the wrong
target is never recorded."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
from pkgfactory import build_package, make_key, replace_header

from edgepack.format import Package
from edgepack.server.http import ondemand as ondemand_mod
from edgepack.server.http.config import ServeConfig
from edgepack.server.http.ondemand import OnDemandDeltas, lease_key, record_key
from edgepack.server.releases import deltas as deltas_mod
from edgepack.server.releases.model import ReleaseInfo, Requirements, release_target_path
from edgepack.server.store import Store, open_store, sha256_file

pytestmark = pytest.mark.skipif(
    not deltas_mod.delta_codec_available(), reason="needs the delta codec"
)


def release(store: Store, path: Path, version: str, notes: bytes) -> ReleaseInfo:
    build_package(path, key=False, extra_sections=[(9, "notes", notes, False)])
    with Package.open(path) as pkg:
        header = pkg.header
    header = replace(header, identity=replace(header.identity, version=version))
    path.write_bytes(replace_header(path.read_bytes(), header, sign_with=make_key(0)))
    store.put_object(path)
    sha, size = sha256_file(path)
    return ReleaseInfo(
        release_target_path("tiny-llama", "beta", version), "tiny-llama", version, "beta",
        10_000, sha, size, Requirements.from_header(header),
    )


@pytest.fixture
def world(tmp_path: Path) -> tuple[Store, OnDemandDeltas, list[ReleaseInfo]]:
    store = open_store(tmp_path / "store")
    rels = [
        release(store, tmp_path / f"{v}.epk", v, v.encode() * 200)
        for v in ("1.0.0", "1.1.0", "1.2.0")
    ]
    config = ServeConfig(str(tmp_path / "store"), delta_wait_seconds=60)
    return store, OnDemandDeltas(store, config), rels


def test_lease_is_taken_once_and_taken_over_when_expired(world) -> None:
    store, deltas, _ = world
    pair = ("a" * 64, "b" * 64)
    assert deltas._take_lease(pair) is True
    assert deltas._take_lease(pair) is False  # live: someone (here: us) computes it
    stale = {"owner": "crashed", "expires": time.time() - 1}
    store.put_bytes(lease_key(*pair), json.dumps(stale).encode())
    assert deltas._take_lease(pair) is True
    assert json.loads(store.get_bytes(lease_key(*pair))[0])["owner"] == deltas.owner


def test_computed_once_then_reused(world) -> None:
    store, deltas, (v1, v2, _) = world
    ref = deltas.lookup(v1, v2)
    assert ref is not None and ref.signed is False and ref.kind == "delta"
    assert deltas.computed == 1 and not store.exists(lease_key(v1.sha256, v2.sha256))
    assert deltas.lookup(v1, v2) == ref and deltas.computed == 1
    fresh = OnDemandDeltas(store, deltas.config)  # another replica: reads the record
    assert fresh.lookup(v1, v2) == ref and fresh.computed == 0
    assert fresh.target(ref.path) == (ref.sha256, ref.length)


def test_a_delta_to_the_wrong_target_is_never_recorded(
    world, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store, deltas, (v1, v2, v3) = world
    real = deltas_mod.make_delta

    def wrong(old: Path, new: Path, out: Path) -> Path | None:
        return real(old, store.local_path(v3.object_key), out)  # leads to 1.2.0

    monkeypatch.setattr(ondemand_mod, "make_delta", wrong)
    assert deltas.lookup(v1, v2) is None
    assert not store.exists(record_key(v1.sha256, v2.sha256))
    assert deltas.lookup(v1, v2) is None and deltas.computed == 0  # not retried
