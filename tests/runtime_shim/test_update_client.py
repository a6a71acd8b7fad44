"""The device update client against a real ``edgepack serve``: install, delta update,
attacks refused with the active model untouched, kill -9 at seeded points, rollback.

Packages are small pkgfactory llama models padded with a few MB of incompressible
bytes (the same in every version), so a delta is tiny and the full package is not.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pkgfactory import make_key
from runtime_fixtures import tiny_spec
from serveproc import ServeProcess

pytest.importorskip("tuf")
pytest.importorskip("fastapi")

from edgepack.packager.convert import convert
from edgepack.packager.importers.synthetic import write_hf_llama
from edgepack.runtime_shim.update import (
    ExpiredMetadataError,
    MetadataSignatureError,
    MixAndMatchError,
    RollbackError,
    UnsafeTargetError,
    UpdateConfig,
    Updater,
    open_slot,
)
from edgepack.runtime_shim.update.plan import verify_plan
from edgepack.server.releases import deltas as deltas_mod
from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import open_store

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


def planned_bytes(world: dict[str, Any], sha: str) -> bytes:
    """The bytes of whichever published package a check planned (v2 once a test
    published it), so tests do not depend on the order they run in."""
    for key in ("v1", "v2"):
        if sha256(world[key]) == sha:
            return world[key].read_bytes()
    raise AssertionError(f"no package of the world has sha256 {sha}")


def updater(world: dict[str, Any], slot_dir: Path, **kw: Any) -> Updater:
    cfg = kw.pop("config", UpdateConfig(read_timeout=5, slow_grace=2))
    return Updater(world["url"], slot_dir, world["root"], cfg, device_id="device-7",
                   channel="beta", model="tiny", **kw)


def test_v1_installs_then_v2_arrives_as_a_delta(world: dict[str, Any], tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    seen: list[tuple[int, int]] = []
    r1 = updater(world, slots, on_progress=lambda done, total: seen.append((done, total)))
    r1 = r1.check_and_apply()
    assert r1.result == "updated", r1
    assert seen[-1] == (r1.full_bytes, r1.full_bytes) and len(seen) > 1
    assert r1.plan == "full" and r1.version == "1.0.0"
    assert r1.bytes_downloaded == r1.full_bytes == world["v1"].stat().st_size
    with open_slot(slots, threads=1) as m:
        assert m.logits([1, 2, 3]).shape[-1] > 0
    assert updater(world, slots).check_and_apply().result == "up_to_date"

    world["repo"].publish(world["v2"], "beta", model="tiny")
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


@pytest.fixture()
def fresh(world: dict[str, Any], tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A store of its own with tiny 1.0.0, a server on it and a device with v1 installed."""
    store = tmp_path / "store"
    repo = ReleaseRepository(open_store(store), KeyRing(tmp_path / "keys"))
    repo.init()
    repo.publish(world["v1"], "beta", model="tiny")
    server = ServeProcess(store, tmp_path / "server.log", "--refresh-seconds", "0.2")
    w = {**world, "store": store, "repo": repo, "server": server,
         "url": f"http://127.0.0.1:{server.port}",
         "root": (store / "metadata" / "1.root.json").read_bytes(), "slots": tmp_path / "slots"}
    try:
        assert updater(w, w["slots"]).check_and_apply().result == "updated"
        yield w
    finally:
        server.stop()


def active_bytes(slots: Path) -> bytes:
    journal = json.loads((slots / "journal.json").read_text())
    return (slots / journal["active"] / "model.epk").read_bytes()


def publish_and_wait(w: dict[str, Any], pkg: Path) -> None:
    w["repo"].publish(pkg, "beta", model="tiny")
    time.sleep(0.6)  # the server's view refreshes every 0.2 s


def refused(w: dict[str, Any], error: type) -> None:
    before = active_bytes(w["slots"])
    u = updater(w, w["slots"])
    with pytest.raises(error):
        u.check()
    assert active_bytes(w["slots"]) == before
    with open_slot(w["slots"], threads=1, verify="full") as m:
        assert np.isfinite(m.logits([1, 2])).all()


def test_tampered_payload_is_refused_and_v1_keeps_serving(fresh: dict[str, Any]) -> None:
    publish_and_wait(fresh, fresh["v2"])
    for obj in (fresh["store"] / "objects" / "sha256").rglob("*"):
        if obj.is_file() and obj.read_bytes() != fresh["v1"].read_bytes():
            data = bytearray(obj.read_bytes())
            data[len(data) // 2] ^= 0xFF
            obj.write_bytes(bytes(data))
    result = updater(fresh, fresh["slots"]).check_and_apply()
    assert result.result == "failed" and result.error == "TargetVerificationError", result
    assert active_bytes(fresh["slots"]) == fresh["v1"].read_bytes()


def test_metadata_signed_by_an_unknown_key_is_refused(fresh: dict[str, Any]) -> None:
    from securesystemslib.signer import CryptoSigner
    from tuf.api.metadata import Metadata

    path = fresh["store"] / "metadata" / "timestamp.json"
    md = Metadata.from_bytes(path.read_bytes())
    md.signed.version += 1
    md.signatures.clear()
    md.sign(CryptoSigner.generate_ed25519())
    path.write_bytes(md.to_bytes())
    refused(fresh, MetadataSignatureError)


def test_rolled_back_timestamp_is_refused(fresh: dict[str, Any]) -> None:
    path = fresh["store"] / "metadata" / "timestamp.json"
    old = path.read_bytes()
    publish_and_wait(fresh, fresh["v2"])
    assert updater(fresh, fresh["slots"]).check_and_apply().result == "updated"
    path.write_bytes(old)
    refused(fresh, RollbackError)


def test_expired_timestamp_is_refused(fresh: dict[str, Any]) -> None:
    from tuf.api.metadata import Metadata

    path = fresh["store"] / "metadata" / "timestamp.json"
    md = Metadata.from_bytes(path.read_bytes())
    md.signed.version += 1
    md.signed.expires = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
    root = Metadata.from_bytes((path.parent / "root.json").read_bytes()).signed
    signer = KeyRing(fresh["store"].parent / "keys").signers_for(root, "timestamp")[0]
    md.signatures.clear()
    md.sign(signer)
    path.write_bytes(md.to_bytes())
    refused(fresh, ExpiredMetadataError)


def resign(w: dict[str, Any], path: Path, role: str, edit: Any) -> bytes:
    """``path``'s metadata after ``edit(signed)``, signed again by ``role``'s real key."""
    from tuf.api.metadata import Metadata

    md = Metadata.from_bytes(path.read_bytes())
    edit(md.signed)
    root = Metadata.from_bytes((path.parent / "root.json").read_bytes()).signed
    md.signatures.clear()
    md.sign(KeyRing(w["store"].parent / "keys").signers_for(root, role)[0])
    path.write_bytes(md.to_bytes())
    return path.read_bytes()


@pytest.mark.parametrize("snapshot_pins_hashes", [True, False])
def test_targets_from_another_snapshot_are_refused(
    fresh: dict[str, Any], snapshot_pins_hashes: bool
) -> None:
    """Mix-and-match: the newest snapshot, served with the targets file of an older one."""
    from tuf.api.metadata import MetaFile

    meta = fresh["store"] / "metadata"
    publish_and_wait(fresh, fresh["v2"])
    n = json.loads((meta / "timestamp.json").read_bytes())["signed"]["meta"]["snapshot.json"]
    snapshot = meta / f"{n['version']}.snapshot.json"
    t = json.loads(snapshot.read_bytes())["signed"]["meta"]["targets.json"]["version"]
    old_targets = (meta / f"{t - 1}.targets.json").read_bytes()  # what the last snapshot signed
    if not snapshot_pins_hashes:  # only the version then says which targets belong
        data = resign(fresh, snapshot, "snapshot",
                      lambda s: s.meta.__setitem__("targets.json", MetaFile(version=t)))

        def point_at_snapshot(ts: Any) -> None:
            ts.version += 1
            ts.snapshot_meta = MetaFile(
                version=n["version"], length=len(data),
                hashes={"sha256": hashlib.sha256(data).hexdigest()},
            )

        resign(fresh, meta / "timestamp.json", "timestamp", point_at_snapshot)
    (meta / f"{t}.targets.json").write_bytes(old_targets)
    refused(fresh, MixAndMatchError)
    result = updater(fresh, fresh["slots"]).check_and_apply()
    assert result.result == "failed" and result.error == "MixAndMatchError", result


def test_nan_producing_update_rolls_back_by_itself(fresh: dict[str, Any]) -> None:
    bad = make_pkg(fresh["slots"].parent, "1.2.0", **{
        "model.norm.weight": np.full(tiny_spec().hidden_size, 3e38, np.float32)
    })
    publish_and_wait(fresh, bad)
    result = updater(fresh, fresh["slots"]).check_and_apply()
    assert result.result == "rolled_back" and "health check" in result.reason, result
    assert active_bytes(fresh["slots"]) == fresh["v1"].read_bytes()
    journal = json.loads((fresh["slots"] / "journal.json").read_text())
    assert journal["state"] == "rolled_back" and sha256(bad) in journal["bad_sha256"]
    assert updater(fresh, fresh["slots"]).check_and_apply().result == "up_to_date"


@pytest.mark.parametrize("path", ["../x.epk", "/etc/passwd", "a/../../b", "a\\b", "a//b"])
def test_target_paths_that_leave_the_tree_are_refused(path: str) -> None:
    answer = {"plan": "full", "release": "9.0.0", "reason": "", "targets": [
        {"path": path, "length": 1, "sha256": "0" * 64, "kind": "package", "signed": True}]}
    with pytest.raises(UnsafeTargetError):
        verify_plan(answer, lambda p: pytest.fail("looked up"), UpdateConfig(), None, None)


def test_signed_chunk_hashes_refetch_only_a_bad_chunk(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """A resumed partial with one corrupt chunk: only that chunk (and the rest) is fetched."""
    from edgepack.runtime_shim.update.download import DownloadTarget, download_target
    from edgepack.runtime_shim.update.fetcher import RangeFetcher
    from edgepack.runtime_shim.update.plan import PlannedTarget

    slots = tmp_path / "slots"
    u = updater(world, slots)
    check = u.check()
    package: PlannedTarget = check.package
    assert package.chunks is not None and len(package.chunks.sha256) > 1
    size = package.chunks.size
    dest = tmp_path / "pkg.epk"
    part = tmp_path / "pkg.epk.part"
    good = planned_bytes(world, package.sha256)
    corrupt = bytearray(good[: 3 * size // 2 + 10])  # chunk 0, chunk 1 (bad), part of 2
    corrupt[size + 5] ^= 0xFF
    part.write_bytes(bytes(corrupt))
    target = DownloadTarget(f"{world['url']}/targets/{package.path}", package.length,
                            package.sha256, package.chunks)
    fetched = download_target(RangeFetcher(UpdateConfig()), target, dest, UpdateConfig())
    assert dest.read_bytes() == good
    assert fetched == len(good) - size  # chunk 0 kept, everything after refetched



def test_a_torn_etag_file_costs_a_refetch_not_an_error(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """A power cut can leave ``.etag`` as garbage beside a good partial file."""
    from edgepack.runtime_shim.update.download import DownloadTarget, download_target
    from edgepack.runtime_shim.update.fetcher import RangeFetcher

    package = updater(world, tmp_path / "slots").check().package
    dest = tmp_path / "pkg.epk"
    good = planned_bytes(world, package.sha256)
    assert package.chunks is not None and len(package.chunks.sha256) > 1
    (tmp_path / "pkg.epk.part").write_bytes(good[: package.chunks.size + 10])  # 1 chunk kept
    (tmp_path / "pkg.epk.etag").write_bytes(b"\xff\xfe\x00torn")
    target = DownloadTarget(f"{world['url']}/targets/{package.path}", package.length,
                            package.sha256, package.chunks)
    download_target(RangeFetcher(UpdateConfig()), target, dest, UpdateConfig())
    assert dest.read_bytes() == good


class HostileFront:
    """A front for the real server that relays metadata and update checks but serves
    every target as ``mode``: ``endless`` (the real bytes, then zeros without end) or a
    ``slow`` drip."""

    def __init__(self, upstream_port: int, mode: str) -> None:
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _relay(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0) or 0))
                c = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                c.request(method, self.path, body=body or None, headers=dict(self.headers))
                r = c.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                self._relay("POST")

            def do_GET(self) -> None:
                if not self.path.startswith("/targets/"):
                    return self._relay("GET")
                c = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                c.request("GET", self.path)
                real = c.getresponse().read()
                self.send_response(200)
                self.end_headers()
                try:
                    if mode == "endless":  # the right bytes, then more forever
                        self.wfile.write(real)
                    while True:
                        if mode == "endless":
                            self.wfile.write(b"\0" * 65536)
                        else:
                            self.wfile.write(b"\0")
                            self.wfile.flush()
                            time.sleep(0.2)
                except OSError:
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(("mode", "error"), [("endless", "DownloadLengthError"),
                                             ("slow", "SlowRetrievalError")])
def test_endless_or_slow_payloads_are_cut_off(fresh: dict[str, Any], mode: str, error: str) -> None:
    publish_and_wait(fresh, fresh["v2"])
    front = HostileFront(fresh["server"].port, mode)
    cfg = UpdateConfig(read_timeout=2, slow_grace=1, min_bytes_per_second=4096, max_attempts=1)
    try:
        result = updater({**fresh, "url": front.url}, fresh["slots"], config=cfg).check_and_apply()
    finally:
        front.close()
    assert result.result == "failed" and result.error == error, result
    assert active_bytes(fresh["slots"]) == fresh["v1"].read_bytes()


def test_a_delta_that_fails_falls_back_to_the_full_package_once(fresh: dict[str, Any]) -> None:
    publish_and_wait(fresh, fresh["v2"])
    # the installed file no longer matches the delta's base: the delta cannot apply
    journal = json.loads((fresh["slots"] / "journal.json").read_text())
    u = updater(fresh, fresh["slots"])
    check = u.check()
    assert check.plan == "delta"
    active = fresh["slots"] / journal["active"] / "model.epk"
    broken = fresh["slots"] / "downloads" / f"{check.delta.sha256}.delta"
    broken.write_bytes(b"not a delta")  # what a corrupt cached delta looks like
    u._downloaded = broken
    result = u.apply()
    assert result.result == "updated" and result.fell_back_to_full, result
    assert active_bytes(fresh["slots"]) == fresh["v2"].read_bytes()
    assert active.read_bytes() == fresh["v1"].read_bytes()  # the old slot kept


def test_package_signed_by_an_unknown_key_is_not_switched_to(
    fresh: dict[str, Any], tmp_path: Path
) -> None:
    publish_and_wait(fresh, fresh["v2"])
    stranger = make_key(5).public_key()
    result = updater(fresh, fresh["slots"], package_keys=[stranger]).check_and_apply()
    assert result.result == "failed" and "Signature" in (result.error or ""), result
    assert active_bytes(fresh["slots"]) == fresh["v1"].read_bytes()
    trusted = updater(fresh, fresh["slots"], package_keys=[make_key(0).public_key()])
    assert trusted.check_and_apply().result == "updated"
