"""Crash safety: `edgepack publish` SIGKILLed at random points against a real S3 API
(moto server on loopback) never leaves metadata that points at missing or partial
objects, and the repository keeps working afterwards.

Half the trials kill after a random delay within one publish's duration; the other
half kill a few milliseconds after a chosen step was logged (``-v``), so the short
windows between metadata writes are hit too. After every kill, *every* metadata file
in the bucket - committed or orphaned - is checked by code independent of edgepack's:
it parses, and everything it references exists with exactly the recorded size and
SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from crashkit import kill_at, run_cli
from s3server import MotoServer, s3_server  # noqa: F401
from test_releases import download, make_pkg, updater

from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import open_store

TRIALS = 20
MiB = 1024 * 1024
BUCKET = "edgepack-crash"
STEPS = ("stored package object", "stored delta ", ".targets.json", ".snapshot.json", "verified ")


class StoreChecker:
    """Independent invariant check, straight through boto3."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.client, self.prefix = client, prefix
        self.verified: dict[tuple[str, str], tuple[int, str]] = {}  # (key, etag) -> (size, sha)

    def objects(self) -> dict[str, dict[str, Any]]:
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=self.prefix + "/"
        ):
            for item in page.get("Contents", []):
                out[item["Key"][len(self.prefix) + 1 :]] = item
        return out

    def content(self, key: str, item: dict[str, Any]) -> tuple[int, str]:
        cache_key = (key, item["ETag"])
        if cache_key not in self.verified:
            body = self.client.get_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}")["Body"]
            digest, size = hashlib.sha256(), 0
            for chunk in body.iter_chunks(MiB):
                digest.update(chunk)
                size += len(chunk)
            self.verified[cache_key] = (size, digest.hexdigest())
        return self.verified[cache_key]

    def problems(self) -> list[str]:
        objects = self.objects()
        problems = []

        def expect(key: str, length: int, sha: str, why: str) -> None:
            item = objects.get(key)
            if item is None:
                problems.append(f"{why}: {key} is missing")
                return
            size, digest = self.content(key, item)
            if (size, digest) != (length, sha):
                problems.append(f"{why}: {key} has {size} bytes / {digest[:12]}")

        for key in sorted(objects):
            if not key.startswith("metadata/"):
                continue
            raw = self.client.get_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}")["Body"].read()
            try:
                signed = json.loads(raw)["signed"]
            except (ValueError, KeyError):
                problems.append(f"{key} is not complete metadata")
                continue
            kind = signed["_type"]
            if kind == "timestamp":
                meta = signed["meta"]["snapshot.json"]
                expect(
                    f"metadata/{meta['version']}.snapshot.json",
                    meta["length"],
                    meta["hashes"]["sha256"],
                    key,
                )
            elif kind == "snapshot":
                meta = signed["meta"]["targets.json"]
                expect(
                    f"metadata/{meta['version']}.targets.json",
                    meta["length"],
                    meta["hashes"]["sha256"],
                    key,
                )
            elif kind == "targets":
                targets = signed["targets"]
                for path, target in targets.items():
                    sha = target["hashes"]["sha256"]
                    expect(f"objects/sha256/{sha}", target["length"], sha, f"{key} {path}")
                    for delta in target.get("custom", {}).get("edgepack", {}).get("deltas", []):
                        if delta["path"] not in targets:
                            problems.append(f"{key} {path}: delta {delta['path']} not listed")
        return problems


@pytest.mark.slow
def test_killing_publish_never_exposes_a_partial_release(
    s3_server: MotoServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    s3_server.create_bucket(BUCKET)
    prefix = f"crash-{uuid.uuid4().hex[:8]}"
    url = f"s3://{BUCKET}/{prefix}"
    keys_dir = tmp_path / "keys"
    env = {
        **os.environ,
        **s3_server.env(),
        "EDGEPACK_S3_PART_SIZE": str(5 * MiB),  # ~6 MiB packages: two parts each
        "EDGEPACK_S3_MULTIPART_THRESHOLD": str(5 * MiB),
    }
    ReleaseRepository(open_store(url), KeyRing(keys_dir)).init()
    checker = StoreChecker(s3_server.client(), prefix)
    rng = random.Random(1234)

    base_pad = rng.randbytes(5 * MiB + MiB // 2)

    def package(n: int) -> Path:
        """~6 MiB: new tensors and a few changed bytes of a shared padding section, so the
        precomputed deltas are real (and cheap) work inside every publish."""
        pad = bytearray(base_pad)
        for _ in range(64):
            pad[rng.randrange(len(pad))] ^= 0xFF
        return make_pkg(tmp_path / f"p{n}.epk", f"1.0.{n}", seed=n, pad=bytes(pad))

    def publish(pkg: Path, kill: str | None = None) -> tuple[int | None, list[str]]:
        args = [
            "publish", str(pkg), "--store", url, "--keys-dir", str(keys_dir),
            "--channel", "beta", "--deltas", "2", "-v",
        ]  # fmt: skip
        if kill is None:
            return run_cli(args, env=env, timeout=60)
        point = kill if kill.startswith("delay") else f"log:{kill}"
        return kill_at(args, point, rng, env=env, timeout=60)

    # calibration run: also the base release
    start = time.monotonic()
    rc, lines = publish(package(0))
    full = time.monotonic() - start
    assert rc == 0, "".join(lines)
    assert checker.problems() == []

    outcomes = []
    for n in range(1, TRIALS + 1):
        kill = f"delay:{rng.uniform(0, full):.3f}" if n % 2 else STEPS[(n // 2) % len(STEPS)]
        rc, lines = publish(package(n), kill)
        outcomes.append((kill, rc, lines[-1].strip() if lines else ""))
        assert rc in (None, 0), "".join(lines)
        problems = checker.problems()
        assert problems == [], f"trial {n} ({kill}): {problems}"
        # the committed state verifies too
        ReleaseRepository(open_store(url)).load()

    killed = sum(rc is None for _, rc, _ in outcomes)
    assert any(last.startswith("stored delta") for _, _, last in outcomes)  # a kill hit it
    print("\n".join(f"{k:>24} rc={rc} last={last}" for k, rc, last in outcomes))
    assert killed >= TRIALS // 2, outcomes  # most trials really were interrupted
    # the repository still publishes, and a stock TUF client follows it
    store = open_store(url)
    final = package(TRIALS + 1)
    result = ReleaseRepository(store, KeyRing(keys_dir)).publish(final, "beta", delta_count=2)
    assert result.release.deltas  # from the committed releases, whatever the kills left
    repo = ReleaseRepository(store)
    assert repo.verify(deep=True) == []
    index = repo.index()
    assert index.latest("tiny-llama", "beta").version == f"1.0.{TRIALS + 1}"
    assert {r.version for r in index} <= {f"1.0.{n}" for n in range(TRIALS + 2)}
    u = updater(store, tmp_path / "device")
    assert download(u, result.release.path) == final.read_bytes()
    # what the killed multipart uploads left is invisible, and can be cleaned up
    store.abort_stale_uploads(older_than=0)
    assert checker.problems() == []
