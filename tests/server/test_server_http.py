"""``edgepack serve`` as a real process on loopback: update checks, TUF metadata for a
stock python-tuf client, resumable payloads, limits, replicas and on-demand deltas.

Packages are small pkgfactory ones with a few MB of incompressible padding (the same
in every version), so a delta is tiny and the full package is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pkgfactory import build_package, make_key, replace_header
from s3server import MotoServer, s3_server  # noqa: F401
from serveproc import ServeProcess
from tuf.ngclient import Updater

from edgepack.format import Package
from edgepack.format.constants import OPERATOR_SET_VERSION
from edgepack.server.releases import deltas as deltas_mod
from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.metadata import RepoPolicy
from edgepack.server.releases.model import in_rollout
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import open_store

OPS = {"llama.decoder": 2, "matmul.int4_group_sym": 1}
PAD = os.urandom(3 * 1024 * 1024)
REFRESH = 1.0  # --refresh-seconds of the servers under test

pytestmark = pytest.mark.skipif(
    not deltas_mod.delta_codec_available(), reason="needs the delta codec"
)


# ----------------------------------------------------------------------- helpers


def make_pkg(path: Path, version: str, *, extra: bytes = b"", min_runtime: str = "0.2.0") -> Path:
    sections = [(8, "pad", PAD, False)] + ([(9, "notes", extra, False)] if extra else [])
    build_package(
        path,
        seed=1,
        key=False,
        min_runtime_version=min_runtime,
        required_operators=tuple(OPS.items()),
        extra_sections=sections,
    )
    with Package.open(path) as pkg:
        header = pkg.header
    header = replace(header, identity=replace(header.identity, name="tiny", version=version))
    path.write_bytes(replace_header(path.read_bytes(), header, sign_with=make_key(0)))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Server(ServeProcess):
    """`edgepack serve` on this module's store, refreshing every REFRESH seconds."""

    def __init__(self, store: Path | str, log: Path, *extra: str, ready: bool = True) -> None:
        super().__init__(store, log, "--refresh-seconds", str(REFRESH), *extra, ready=ready)

    def check(self, **fields: Any) -> tuple[int, Any]:
        return self.post("/v1/update-check", device(**fields))


def device(**fields: Any) -> dict[str, Any]:
    base = {
        "device_id": "device-0",
        "installed_sha256": None,
        "runtime_version": "0.2.0",
        "operator_set_version": OPERATOR_SET_VERSION,
        "operators": OPS,
        "channel": "beta",
        "model": "tiny",
        "adapters": [],
        "free_bytes": 1 << 30,
    }
    return {**base, **fields}


def ids(version: str, rollout_bp: int, inside: bool) -> str:
    """A device id that is (or is not) in the cohort of tiny/beta/<version>."""
    return next(
        f"device-{i}"
        for i in range(10_000)
        if in_rollout(f"device-{i}", "tiny", "beta", version, rollout_bp) == inside
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A store with tiny 1.0.0 (100%) and 1.1.0 (50%, precomputed delta) on beta,
    served by one `edgepack serve`."""
    tmp = tmp_path_factory.mktemp("serve")
    store = tmp / "store"
    repo = ReleaseRepository(open_store(store), KeyRing(tmp / "keys"))
    repo.init()
    v1 = make_pkg(tmp / "v1.epk", "1.0.0")
    v2 = make_pkg(tmp / "v2.epk", "1.1.0", extra=b"release notes " * 100)
    repo.publish(v1, "beta")
    rel2 = repo.publish(v2, "beta", rollout=50).release
    assert rel2.deltas, "publish precomputed no delta"
    server = Server(store, tmp / "server.log")
    try:
        yield {"tmp": tmp, "store": store, "repo": repo, "v1": v1, "v2": v2, "rel2": rel2,
               "server": server}
    finally:
        server.stop()


# ----------------------------------------------------------------------- update check


def test_check_from_v1_answers_the_precomputed_delta(world: dict[str, Any]) -> None:
    server, rel2 = world["server"], world["rel2"]
    inside = ids("1.1.0", 5000, True)
    status, plan = server.check(device_id=inside, installed_sha256=sha256(world["v1"]))
    assert status == 200, plan
    delta = rel2.deltas[0]
    assert plan["plan"] == "delta" and plan["release"] == "1.1.0"
    assert plan["sha256"] == sha256(world["v2"])
    assert plan["bytes"] == delta.length < rel2.length
    assert [(t["path"], t["sha256"], t["kind"]) for t in plan["targets"]] == [
        (delta.path, delta.sha256, "delta"),
        (rel2.path, rel2.sha256, "package"),
    ]
    assert "delta from 1.0.0" in plan["reason"]
    # the delta, fetched by its plain target path, patches v1 into v2 exactly
    from edgepack.format.delta import apply_delta

    status, _, body = server.get(f"/targets/{delta.path}")
    assert status == 200 and hashlib.sha256(body).hexdigest() == delta.sha256
    (world["tmp"] / "d.epkd").write_bytes(body)
    apply_delta(world["v1"], world["tmp"] / "d.epkd", world["tmp"] / "patched.epk")
    assert sha256(world["tmp"] / "patched.epk") == plan["sha256"]


def test_unknown_or_no_installed_hash_answers_full(world: dict[str, Any]) -> None:
    server, rel2 = world["server"], world["rel2"]
    inside = ids("1.1.0", 5000, True)
    for installed in ("ab" * 32, None):
        status, plan = server.check(device_id=inside, installed_sha256=installed)
        assert status == 200, plan
        assert plan["plan"] == "full" and plan["release"] == "1.1.0"
        assert plan["bytes"] == rel2.length and plan["sha256"] == rel2.sha256
        assert plan["targets"] == [
            {"path": rel2.path, "length": rel2.length, "sha256": rel2.sha256,
             "kind": "package", "signed": True}
        ]


def test_device_outside_the_cohort_stays_on_its_release(world: dict[str, Any]) -> None:
    outside = ids("1.1.0", 5000, False)
    status, plan = world["server"].check(device_id=outside, installed_sha256=sha256(world["v1"]))
    assert status == 200, plan
    assert plan["plan"] == "none" and plan["release"] == "1.0.0"
    assert "1.1.0 is rolling out to 50%" in plan["reason"]
    # the same device with nothing installed gets what its cohort has: 1.0.0
    status, plan = world["server"].check(device_id=outside)
    assert plan["plan"] == "full" and plan["release"] == "1.0.0"


def test_too_old_runtime_is_told_the_version_it_needs(world: dict[str, Any]) -> None:
    status, plan = world["server"].check(runtime_version="0.1.9")
    assert status == 200, plan
    assert plan["plan"] == "none" and plan["targets"] == []
    assert plan["reason"].startswith("no compatible release on beta: ")
    assert "needs runtime >= 0.2.0 (this device runs 0.1.9)" in plan["reason"]
    status, plan = world["server"].check(operators={"llama.decoder": 1})
    assert plan["plan"] == "none" and "llama.decoder@2" in plan["reason"]


def test_up_to_date_and_unknown_channel(world: dict[str, Any]) -> None:
    inside = ids("1.1.0", 5000, True)
    status, plan = world["server"].check(device_id=inside, installed_sha256=sha256(world["v2"]))
    assert (status, plan["plan"], plan["release"]) == (200, "none", "1.1.0")
    assert plan["reason"].startswith("up to date")
    status, plan = world["server"].check(channel="nightly")
    assert (status, plan["plan"]) == (200, "none")
    assert plan["reason"] == "no release of tiny on nightly"


def test_too_little_storage_is_a_typed_refusal(world: dict[str, Any]) -> None:
    inside = ids("1.1.0", 5000, True)
    v1, rel2 = world["v1"], world["rel2"]
    status, body = world["server"].check(device_id=inside, free_bytes=1000)
    assert status == 409, body
    assert body["error"] == "insufficient_storage" and body["release"] == "1.1.0"
    assert body["needed_bytes"] == rel2.length and body["free_bytes"] == 1000
    # with v1 installed, the delta needs room for itself and the patched file; with
    # room for the full package only, the full package it is
    status, plan = world["server"].check(
        device_id=inside, installed_sha256=sha256(v1), free_bytes=rel2.length
    )
    assert (status, plan["plan"]) == (200, "full")


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        {"device_id": "x"},  # missing fields
        {**device(), "device_id": "x" * 257},
        {**device(), "installed_sha256": "XYZ"},
        {**device(), "runtime_version": "one"},
        {**device(), "free_bytes": -1},
        {**device(), "operators": {f"op{i}": 1 for i in range(600)}},
        {**device(), "adapters": ["a"] * 65},
        {**device(), "channel": "../x"},
        {**device(), "surprise": 1},
    ],
)
def test_malformed_checks_are_422(world: dict[str, Any], body: Any) -> None:
    status, answer = world["server"].post("/v1/update-check", body)
    assert status == 422, answer


def test_oversized_check_is_413(world: dict[str, Any]) -> None:
    status, answer = world["server"].post(
        "/v1/update-check", {**device(), "device_id": "x" * 100_000}
    )
    assert status == 413 and answer["error"] == "request_too_large"


# ----------------------------------------------------------------------- TUF and payloads


def test_stock_tuf_client_refreshes_and_downloads_over_http(world: dict[str, Any]) -> None:
    server, tmp, rel2 = world["server"], world["tmp"], world["rel2"]
    meta, targets = tmp / "tuf-meta", tmp / "tuf-targets"
    meta.mkdir()
    targets.mkdir()
    status, _, root = server.get("/metadata/1.root.json")
    assert status == 200
    base = f"http://127.0.0.1:{server.port}"
    u = Updater(str(meta), f"{base}/metadata/", str(targets), f"{base}/targets/", bootstrap=root)
    u.refresh()
    info = u.get_targetinfo(rel2.path)
    assert info is not None and info.hashes["sha256"] == rel2.sha256
    assert Path(u.download_target(info)).read_bytes() == world["v2"].read_bytes()


def test_metadata_is_served_as_published(world: dict[str, Any]) -> None:
    server, store = world["server"], world["store"]
    status, headers, body = server.get("/metadata/timestamp.json")
    assert status == 200 and body == (store / "metadata" / "timestamp.json").read_bytes()
    assert headers["cache-control"] == "no-cache"
    status, headers, _ = server.get("/metadata/2.targets.json")
    assert status == 200 and "immutable" in headers["cache-control"]
    assert server.get("/metadata/2.targets.json", {"if-none-match": headers["etag"]})[0] == 304
    assert server.get("/metadata/99.root.json")[0] == 404
    assert server.get("/metadata/keys.json")[0] in (404, 422)


def test_ranged_download_interrupted_at_half_resumes_with_if_range(
    world: dict[str, Any],
) -> None:
    server, rel2 = world["server"], world["rel2"]
    path = f"/targets/tiny/beta/{rel2.sha256}.tiny-1.1.0.epk"  # consistent-snapshot name
    size = rel2.length
    transferred = 0
    c = server.conn()
    c.request("GET", path)
    r = c.getresponse()
    assert r.status == 200 and int(r.getheader("content-length")) == size
    etag = r.getheader("etag")
    assert etag == f'"{rel2.sha256}"'
    first = r.read(size // 2)  # ... and the connection drops
    transferred += len(first)
    c.close()
    status, headers, rest = server.get(path, {"range": f"bytes={len(first)}-", "if-range": etag})
    assert status == 206, headers
    assert headers["content-range"] == f"bytes {len(first)}-{size - 1}/{size}"
    assert int(headers["content-length"]) == len(rest)
    transferred += len(rest)
    assert transferred <= 1.05 * size
    assert hashlib.sha256(first + rest).hexdigest() == rel2.sha256


def test_range_edge_cases(world: dict[str, Any]) -> None:
    server, rel2 = world["server"], world["rel2"]
    path, size, etag = f"/targets/{rel2.path}", rel2.length, f'"{rel2.sha256}"'
    data = world["v2"].read_bytes()
    status, headers, body = server.get(path, {"range": "bytes=-10"})
    assert (status, body) == (206, data[-10:])
    status, headers, body = server.get(path, {"range": "bytes=5-9"})
    assert (status, body, headers["content-length"]) == (206, data[5:10], "5")
    for bad in (f"bytes={size}-", "bytes=9-5", "bytes=abc", "bytes=-0"):
        status, headers, _ = server.get(path, {"range": bad})
        assert status == 416, bad
        assert headers["content-range"] == f"bytes */{size}"
    # a stale If-Range (other bytes) gets the whole object, not a splice
    status, headers, body = server.get(path, {"range": "bytes=5-", "if-range": '"0000"'})
    assert (status, len(body)) == (200, size)
    status, headers, body = server.get(path, {"if-none-match": etag})
    assert (status, body, headers["etag"]) == (304, b"", etag)
    c = server.conn()
    c.request("HEAD", path)
    r = c.getresponse()
    assert (r.status, r.getheader("content-length"), r.read()) == (200, str(size), b"")
    c.close()
    assert server.get("/targets/tiny/beta/nope.epk")[0] == 404
    assert server.get(f"/targets/x/{'0' * 64}.nope.epk")[0] == 404


def test_health_openapi_and_access_log(world: dict[str, Any]) -> None:
    server = world["server"]
    assert server.get("/healthz")[0] == 200
    status, _, body = server.get("/readyz")
    assert status == 200 and json.loads(body)["timestamp_version"] >= 3
    status, _, body = server.get("/openapi.json")
    spec = json.loads(body)
    check = spec["paths"]["/v1/update-check"]["post"]
    assert {"200", "409", "413", "422"} <= set(check["responses"])
    schema = spec["components"]["schemas"]["UpdateCheck"]
    assert set(schema["properties"]) == {
        "device_id", "installed_sha256", "runtime_version", "operator_set_version",
        "operators", "channel", "model", "adapters", "free_bytes",
    }
    assert set(spec["components"]["schemas"]["UpdatePlan"]["properties"]) == {
        "plan", "release", "bytes", "sha256", "targets", "reason",
    }
    server.post("/v1/update-check", device(device_id="logged-device"))
    time.sleep(0.2)
    lines = [x for x in server.access_lines() if x["path"] == "/v1/update-check"]
    last = lines[-1]
    assert last["status"] == 200 and last["plan"] == "full" and last["bytes"] > 0
    assert {"request_id", "device", "latency_ms"} <= set(last)
    assert "logged-device" not in server.log.read_text()


# ----------------------------------------------------------------------- replicas


def test_two_replicas_see_a_publish_and_compute_a_missing_delta_once(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = ReleaseRepository(open_store(store), KeyRing(tmp_path / "keys"))
    repo.init(policy=RepoPolicy(delta_count=0))  # no precomputed deltas: all on demand
    v1 = make_pkg(tmp_path / "v1.epk", "1.0.0")
    v2 = make_pkg(tmp_path / "v2.epk", "1.1.0", extra=b"notes " * 300)
    repo.publish(v1, "beta")
    extra = ("--delta-wait-seconds", "120")
    a = Server(store, tmp_path / "a.log", *extra)
    try:
        b = Server(store, tmp_path / "b.log", *extra)
    except BaseException:
        a.stop()
        raise
    try:
        for s in (a, b):
            assert s.check()[1]["release"] == "1.0.0"
        repo.publish(v2, "beta")
        published = time.monotonic()
        seen: dict[int, float] = {}
        while len(seen) < 2 and time.monotonic() - published < 30:
            for s in (a, b):
                if s.port not in seen and s.check()[1]["release"] == "1.1.0":
                    seen[s.port] = time.monotonic() - published
            time.sleep(0.05)
        assert len(seen) == 2 and max(seen.values()) <= REFRESH + 2.0, seen
        # 32 concurrent checks from v1 across both replicas: one computation
        installed = sha256(v1)

        def one(i: int) -> tuple[int, Any]:
            return (a, b)[i % 2].check(device_id=f"d{i}", installed_sha256=installed)

        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(one, range(32)))
        assert all(status == 200 for status, _ in answers), answers
        assert {p["plan"] for _, p in answers} == {"delta"}
        refs = {json.dumps(p["targets"][0], sort_keys=True) for _, p in answers}
        assert len(refs) == 1
        ref = json.loads(refs.pop())
        assert ref["signed"] is False and ref["kind"] == "delta"
        logs = a.log.read_text() + b.log.read_text()
        assert logs.count("on-demand delta computed") == 1
        # both replicas serve the same bytes, and they patch v1 into v2 exactly
        from edgepack.format.delta import apply_delta

        bodies = {s.get(f"/targets/{ref['path']}")[2] for s in (a, b)}
        assert len(bodies) == 1
        body = bodies.pop()
        assert hashlib.sha256(body).hexdigest() == ref["sha256"]
        (tmp_path / "d.epkd").write_bytes(body)
        apply_delta(v1, tmp_path / "d.epkd", tmp_path / "out.epk")
        assert sha256(tmp_path / "out.epk") == sha256(v2)
    finally:
        a.stop()
        b.stop()




def test_uninitialised_store_is_not_ready_and_checks_are_503(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    server = Server(tmp_path / "empty", tmp_path / "log", ready=False)
    try:
        status, _, body = server.get("/readyz")
        assert status == 503 and "repo init" in json.loads(body)["reason"]
        status, body = server.check()
        assert status == 503 and body["error"] == "unavailable"
    finally:
        server.stop()


def test_several_workers_answer_alike(world: dict[str, Any]) -> None:
    server = Server(world["store"], world["tmp"] / "workers.log", "--workers", "2")
    try:
        answers = {json.dumps(server.check(device_id=f"w{i}")[1]["plan"]) for i in range(8)}
        assert answers <= {'"full"'}
    finally:
        server.stop()


# ----------------------------------------------------------------------- S3


def test_s3_store_served_directly_and_by_redirect(
    s3_server: MotoServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    s3_server.create_bucket("serve")
    url = f"s3://serve/{tmp_path.name}"
    repo = ReleaseRepository(open_store(url), KeyRing(tmp_path / "keys"))
    repo.init(policy=RepoPolicy(delta_count=0))
    v1 = make_pkg(tmp_path / "v1.epk", "1.0.0")
    rel = repo.publish(v1, "beta").release
    for extra in ((), ("--redirect", "--presign-seconds", "60")):
        server = Server(url, tmp_path / f"log{len(extra)}", *extra)
        try:
            status, plan = server.check()
            assert (status, plan["plan"], plan["sha256"]) == (200, "full", rel.sha256)
            path = f"/targets/{rel.path}"
            status, headers, body = server.get(path, {"range": "bytes=100-"})
            if not extra:
                assert status == 206 and body == v1.read_bytes()[100:]
                continue
            assert status == 307 and headers["etag"] == f'"{rel.sha256}"'
            location = headers["location"]
            assert location.startswith(s3_server.endpoint_url)
            import urllib.request

            with urllib.request.urlopen(location, timeout=30) as r:
                assert hashlib.sha256(r.read()).hexdigest() == rel.sha256
        finally:
            server.stop()


# ----------------------------------------------------------------------- the OpenAPI contract


def test_openapi_document_matches_the_server(world: dict[str, Any], tmp_path: Path) -> None:
    """schemathesis (every check) against the running server: generated requests for
    every documented operation, no 5xx, every answer (status, headers, content type,
    body) as the document says, invalid requests refused and valid ones accepted."""
    tool = Path(sys.executable).with_name("schemathesis")
    if not tool.exists():
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    url = f"http://127.0.0.1:{world['server'].port}/openapi.json"
    run = subprocess.run(
        [str(tool), "run", url, "--checks", "all", "--max-examples", "60", "--workers", "1",
         "--seed", "1", "--no-color"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_serve_refuses_a_bad_store_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgepack.cli import main as cli_main

    assert cli_main(["serve", "--store", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "does not exist" in err
    (tmp_path / "here").mkdir()
    assert cli_main(["serve", "--store", str(tmp_path / "here"), "--redirect"]) == 2
    assert "--redirect needs an s3:// store" in capsys.readouterr().err
