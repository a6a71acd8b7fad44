"""`edgepack repo gc` (issue 11 item 13): lists objects no metadata version references,
deletes them only with --delete, never an object any stored targets version names nor
one younger than the grace period; and publish clears a killed publish's temporaries."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from s3server import MotoServer, s3_server  # noqa: F401
from test_releases import make_pkg

from edgepack.cli import main
from edgepack.cli.exit_codes import EXIT_CORRUPT, EXIT_OK
from edgepack.server.releases.gc import collect_garbage
from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import open_store

DAY = 24 * 3600


def _age(path: Path, seconds: float) -> None:
    when = time.time() - seconds
    os.utime(path, (when, when))


@pytest.fixture
def repo(tmp_path: Path) -> tuple[ReleaseRepository, Path]:
    store_dir = tmp_path / "store"
    rr = ReleaseRepository(open_store(store_dir), KeyRing(tmp_path / "keys"))
    rr.init()
    rr.publish(make_pkg(tmp_path / "a.epk", "1.0.0", seed=1), "beta", delta_count=0)
    return rr, store_dir


def _orphan(tmp_path: Path, rr: ReleaseRepository, name: str, seed: int) -> Path:
    """What a publish that lost its race leaves: an object nothing references."""
    info = rr.store.put_object(make_pkg(tmp_path / name, "9.9.9", seed=seed))
    return Path(rr.store.local_path(info.key))


def test_gc_lists_deletes_only_old_unreferenced_objects(
    repo: tuple[ReleaseRepository, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rr, store_dir = repo
    old, young = _orphan(tmp_path, rr, "o.epk", 7), _orphan(tmp_path, rr, "y.epk", 8)
    _age(old, 2 * DAY)
    for p in (store_dir / "objects/sha256").iterdir():
        if p not in (old, young):
            _age(p, 2 * DAY)  # referenced objects are kept whatever their age
    capsys.readouterr()
    assert main(["repo", "gc", "--store", str(store_dir)]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"unreferenced objects/sha256/{old.name}" in out
    assert young.name not in out and "1 younger than 24 h kept" in out
    assert old.exists()  # a dry run deletes nothing
    assert main(["repo", "gc", "--store", str(store_dir), "--delete"]) == EXIT_OK
    assert not old.exists() and young.exists()
    assert main(["repo", "verify", "--store", str(store_dir), "--deep"]) == EXIT_OK


def test_gc_keeps_objects_of_older_metadata_versions(
    repo: tuple[ReleaseRepository, Path], tmp_path: Path
) -> None:
    rr, store_dir = repo
    first = rr.index().latest("tiny-llama", "beta")  # type: ignore[union-attr]
    rr.publish(make_pkg(tmp_path / "b.epk", "1.1.0", seed=2), "beta", delta_count=0)
    for p in (store_dir / "objects/sha256").iterdir():
        _age(p, 2 * DAY)
    report = collect_garbage(rr.store, delete=True)
    assert report.unreferenced == ()
    assert rr.store.exists(first.object_key)


def test_reusing_an_orphan_makes_it_young(
    repo: tuple[ReleaseRepository, Path], tmp_path: Path
) -> None:
    """A publish that finds its payload already stored refreshes its time, so a gc
    running beside it does not delete the object it is about to reference."""
    rr, _ = repo
    pkg = make_pkg(tmp_path / "c.epk", "2.0.0", seed=3)
    path = Path(rr.store.local_path(rr.store.put_object(pkg).key))
    _age(path, 2 * DAY)
    rr.store.put_object(pkg)
    assert collect_garbage(rr.store).unreferenced == ()


def test_gc_refuses_unreadable_metadata(
    repo: tuple[ReleaseRepository, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, store_dir = repo
    (store_dir / "metadata/99.targets.json").write_text("garbage")
    capsys.readouterr()
    assert main(["repo", "gc", "--store", str(store_dir), "--delete"]) == EXIT_CORRUPT
    assert "gc refuses" in capsys.readouterr().err


def test_publish_clears_a_killed_publishs_temporaries(
    repo: tuple[ReleaseRepository, Path], tmp_path: Path
) -> None:
    rr, store_dir = repo
    dead = 2**22 + 12345  # above the default pid_max: never a running process
    stale = store_dir / "objects/sha256" / f".tmp-{'0' * 64}-{dead}-abcdef"
    live = store_dir / "metadata" / f".tmp-timestamp.json-{os.getpid()}-abcdef"
    stale.write_bytes(b"half an object")
    live.write_bytes(b"a writer still running")
    rr.publish(make_pkg(tmp_path / "d.epk", "1.2.0", seed=4), "beta", delta_count=0)
    assert not stale.exists()
    assert live.exists()


def test_s3_objects_have_a_time_and_touch_renews_it(
    s3_server: MotoServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    """gc's grace period needs the object's time; a reused object must look new."""
    s3_server.create_bucket("edgepack-gc")
    store = open_store(f"s3://edgepack-gc/{uuid.uuid4().hex[:12]}")
    info = store.put_object(make_pkg(tmp_path / "s.epk", "1.0.0"))
    first = store.stat(info.key)
    assert first is not None and first.modified is not None
    assert [o.modified for o in store.list("objects/")] == [first.modified]
    time.sleep(1.1)  # S3 times have one-second resolution
    store.touch(info.key)
    again = store.stat(info.key)
    assert again is not None and again.modified > first.modified
    assert again.sha256 == first.sha256 and again.size == first.size
