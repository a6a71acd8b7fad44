"""Incomplete S3 multipart uploads a killed publish leaves (issue 11 item 13): invisible,
but billed. The next publish aborts the ones idle longer than a safe age (an hour: a live
upload lands a part every few seconds), `repo gc` lists them and aborts them with
--delete; a recent one, a live publisher's, is kept. Against a real S3 API (moto)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from s3server import MotoServer, s3_server  # noqa: F401
from test_releases import make_pkg

from edgepack.cli import main
from edgepack.cli.exit_codes import EXIT_OK
from edgepack.server.releases.gc import collect_garbage
from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import open_store
from edgepack.server.store.s3 import S3Store

BUCKET = "edgepack-stale-uploads"
MiB = 1024 * 1024
HOUR = 3600.0
_PUBLISH_KILLED_AFTER_ONE_PART = """
import os, signal, sys
from edgepack.cli import main
from edgepack.server.store.s3 import S3Store

make = S3Store._make_client

class KillAfterOnePart:
    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if name != "upload_part":
            return fn
        def part(**kwargs):
            fn(**kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        return part

S3Store._make_client = lambda self, region: KillAfterOnePart(make(self, region))
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def s3_env(s3_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:  # noqa: F811
    s3_server.create_bucket(BUCKET)
    env = {
        **s3_server.env(),
        "EDGEPACK_S3_PART_SIZE": str(5 * MiB),  # ~6 MiB packages: two parts each
        "EDGEPACK_S3_MULTIPART_THRESHOLD": str(5 * MiB),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return {**os.environ, **env}


def _store() -> S3Store:
    store = open_store(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}")
    assert isinstance(store, S3Store)
    return store


def test_only_idle_uploads_of_the_stores_objects_are_aborted(s3_env: dict[str, str]) -> None:
    store = _store()
    client = store._client
    mine = f"{store.prefix}/objects/sha256/{'a' * 64}"
    up = client.create_multipart_upload(Bucket=BUCKET, Key=mine)["UploadId"]
    client.upload_part(Bucket=BUCKET, Key=mine, UploadId=up, PartNumber=1, Body=b"x" * 1000)
    other = f"{store.prefix}/elsewhere/file"  # not an edgepack object: never touched
    client.create_multipart_upload(Bucket=BUCKET, Key=other)
    [pending] = store.pending_uploads()
    assert (pending.key, pending.upload_id) == (f"objects/sha256/{'a' * 64}", up)
    assert pending.size == 1000
    assert pending.last_activity >= pending.started
    assert store.remove_stale_temporaries() == 0  # an hour is not over: a live upload, kept
    # two hours after its last part, on the upload's own clock (not this machine's)
    assert store.abort_idle_uploads(HOUR, now=pending.last_activity + 2 * HOUR) == [pending]
    assert store.pending_uploads() == []
    left = client.list_multipart_uploads(Bucket=BUCKET, Prefix=store.prefix + "/")["Uploads"]
    assert [u["Key"] for u in left] == [other]


def test_killed_publish_upload_is_listed_by_gc_and_aborted_by_the_next_publish(
    s3_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, keys = _store(), tmp_path / "keys"
    url = store.url
    ReleaseRepository(store, KeyRing(keys)).init()
    pad = os.urandom(6 * MiB)

    def publish_args(n: int) -> list[str]:
        pkg = make_pkg(tmp_path / f"p{n}.epk", f"1.0.{n}", seed=n, pad=pad)
        return ["publish", str(pkg), "--store", url, "--keys-dir", str(keys), "--channel",
                "beta", "--deltas", "0"]  # fmt: skip

    killed = subprocess.run(
        [sys.executable, "-c", _PUBLISH_KILLED_AFTER_ONE_PART, *publish_args(1)],
        env=s3_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    [left] = store.pending_uploads()  # the test's premise: the kill left an upload
    assert left.size > 0  # one part or both landed (they go in parallel), never completed

    capsys.readouterr()
    assert main(["repo", "gc", "--store", url]) == EXIT_OK  # within the grace period
    out = capsys.readouterr().out
    assert "0 incomplete upload(s)" in out and "1 more recent kept" in out
    assert main(["repo", "gc", "--store", url, "--grace", "0"]) == EXIT_OK  # dry run
    out = capsys.readouterr().out
    assert f"incomplete upload {left.key}" in out and "to abort" in out
    assert store.pending_uploads() == [left]

    assert main(publish_args(2)) == EXIT_OK  # default safe age: a recent upload is kept
    assert store.pending_uploads() == [left]
    os.environ["EDGEPACK_S3_STALE_UPLOAD_SECONDS"] = "0"  # as if an hour had passed
    try:
        assert main(publish_args(3)) == EXIT_OK
    finally:
        del os.environ["EDGEPACK_S3_STALE_UPLOAD_SECONDS"]
    assert store.pending_uploads() == []


def test_gc_delete_aborts_idle_uploads(s3_env: dict[str, str], tmp_path: Path) -> None:
    store = _store()
    ReleaseRepository(store, KeyRing(tmp_path / "keys")).init()
    key = f"{store.prefix}/objects/sha256/{'b' * 64}"
    store._client.create_multipart_upload(Bucket=BUCKET, Key=key)
    report = collect_garbage(store, grace_seconds=0)
    assert [u.key for u in report.stale_uploads] == [f"objects/sha256/{'b' * 64}"]
    assert store.pending_uploads() != []  # listing aborts nothing
    report = collect_garbage(store, delete=True, grace_seconds=0)
    assert len(report.stale_uploads) == 1 and store.pending_uploads() == []
