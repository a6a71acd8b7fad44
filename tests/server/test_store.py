"""The store contract, run against both backends: a local directory and S3 (a real moto
server on loopback, see s3server.py). Local-only details (temporaries, fsync'd
renames, permissions) at the end; S3-only ones (multipart, retries) in
test_store_s3.py."""

from __future__ import annotations

import hashlib
import io
import os
import threading
import uuid
from pathlib import Path

import pytest
from s3server import MotoServer, s3_server  # noqa: F401

from edgepack.cli.exit_codes import EXIT_USAGE, exit_code_for
from edgepack.server.errors import (
    ConcurrentUpdateError,
    InvalidStoreURLError,
    ObjectNotFoundError,
    StoreError,
)
from edgepack.server.store import LocalStore, Store, object_key, open_store

BUCKET = "edgepack-store-tests"


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return open_store(tmp_path / "store")
    server: MotoServer = request.getfixturevalue("s3_server")
    server.create_bucket(BUCKET)
    return open_store(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/repo")


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------ the contract


def test_metadata_roundtrip_and_overwrite(store: Store) -> None:
    etag1 = store.put_bytes("metadata/timestamp.json", b'{"v": 1}')
    data, etag = store.get_bytes("metadata/timestamp.json")
    assert data == b'{"v": 1}' and etag == etag1
    etag2 = store.put_bytes("metadata/timestamp.json", b'{"v": 2}')
    assert etag2 != etag1
    assert store.get_bytes("metadata/timestamp.json")[0] == b'{"v": 2}'
    assert store.stat("metadata/timestamp.json").size == 8


def test_create_only_write_refuses_existing(store: Store) -> None:
    store.put_bytes("metadata/2.targets.json", b"first", if_absent=True)
    with pytest.raises(ConcurrentUpdateError) as info:
        store.put_bytes("metadata/2.targets.json", b"second", if_absent=True)
    assert info.value.retriable
    assert store.get_bytes("metadata/2.targets.json")[0] == b"first"


def test_compare_and_swap(store: Store) -> None:
    store.put_bytes("metadata/timestamp.json", b"v1")
    _, etag = store.get_bytes("metadata/timestamp.json")
    store.put_bytes("metadata/timestamp.json", b"v2", if_match=etag)
    with pytest.raises(ConcurrentUpdateError):  # stale token: someone else wrote v2
        store.put_bytes("metadata/timestamp.json", b"v3", if_match=etag)
    assert store.get_bytes("metadata/timestamp.json")[0] == b"v2"
    with pytest.raises(ConcurrentUpdateError):  # the object went away meanwhile
        store.put_bytes("metadata/gone.json", b"x", if_match=etag)


def test_missing_objects(store: Store) -> None:
    assert store.stat("metadata/nope.json") is None
    assert not store.exists("metadata/nope.json")
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("metadata/nope.json")
    with pytest.raises(ObjectNotFoundError):
        store.iter_bytes("objects/sha256/" + "0" * 64)
    store.delete("metadata/nope.json")  # deleting nothing is fine


def test_content_addressed_put_is_idempotent(store: Store, tmp_path: Path) -> None:
    data = os.urandom(300_000)
    src = write(tmp_path / "pkg.epk", data)
    info = store.put_object(src)
    sha = hashlib.sha256(data).hexdigest()
    assert info.key == object_key(sha) == f"objects/sha256/{sha}"
    assert info.size == len(data) and info.sha256 == sha
    again = store.put_object(src, expected_sha256=sha)
    assert again.key == info.key
    assert b"".join(store.iter_bytes(info.key)) == data
    assert [o.key for o in store.list("objects/")] == [info.key]


def test_put_refuses_a_file_that_changed(store: Store, tmp_path: Path) -> None:
    src = write(tmp_path / "pkg.epk", b"new bytes")
    with pytest.raises(StoreError, match="changed"):
        store.put_object(src, expected_sha256=hashlib.sha256(b"old bytes").hexdigest())
    assert list(store.list("objects/")) == []


def test_put_stream(store: Store) -> None:
    data = os.urandom(70_000)
    info = store.put_object_stream(io.BytesIO(data))
    assert info.key == object_key(hashlib.sha256(data).hexdigest())
    assert store.read_range(info.key, 0, len(data)) == data


def test_byte_ranges(store: Store, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    key = store.put_object(write(tmp_path / "p", data)).key
    assert store.read_range(key, 0, 10) == data[:10]
    assert store.read_range(key, 1_000_000, 2_500_000) == data[1_000_000:3_500_000]
    assert b"".join(store.iter_bytes(key, start=len(data) - 5)) == data[-5:]
    assert store.read_range(key, len(data) - 3, 100) == data[-3:]  # clipped at the end
    assert store.read_range(key, 5, 0) == b""
    chunks = list(store.iter_bytes(key, chunk_size=1024 * 1024))
    assert len(chunks) >= 4 and b"".join(chunks) == data


def test_download_verifies(store: Store, tmp_path: Path) -> None:
    data = os.urandom(50_000)
    key = store.put_object(write(tmp_path / "p", data)).key
    out = store.download(key, tmp_path / "copy")
    assert out.read_bytes() == data
    with pytest.raises(StoreError, match="sha256"):
        store.download(key, tmp_path / "bad", expected_sha256="0" * 64)
    with pytest.raises(StoreError, match="bytes"):
        store.download(key, tmp_path / "bad", expected_size=1)
    assert not (tmp_path / "bad").exists()
    assert not list(tmp_path.glob(".bad*"))  # no partial file left behind


def test_list_prefix_and_delete(store: Store) -> None:
    for key in ("metadata/1.root.json", "metadata/root.json", "metadata/timestamp.json"):
        store.put_bytes(key, key.encode())
    store.put_bytes("other/x", b"x")
    keys = [o.key for o in store.list("metadata/")]
    assert keys == ["metadata/1.root.json", "metadata/root.json", "metadata/timestamp.json"]
    assert [o.key for o in store.list("metadata/root")] == ["metadata/root.json"]
    assert len(list(store.list())) == 4
    store.delete("metadata/root.json")
    assert not store.exists("metadata/root.json")


@pytest.mark.parametrize(
    "key", ["", "/abs", "a//b", "../up", "a/../b", "a/./b", "dir/", "a b", ".tmp-x", "x/.tmp1"]
)
def test_invalid_keys(store: Store, key: str) -> None:
    with pytest.raises(ValueError):
        store.put_bytes(key, b"x")


def test_concurrent_compare_and_swap_loses_no_update(store: Store) -> None:
    """Writers doing read-modify-write with if_match: every increment survives."""
    store.put_bytes("metadata/counter", b"0")
    writers, per_writer = 4, 5

    def work() -> None:
        for _ in range(per_writer):
            while True:
                data, etag = store.get_bytes("metadata/counter")
                try:
                    store.put_bytes("metadata/counter", b"%d" % (int(data) + 1), if_match=etag)
                    break
                except ConcurrentUpdateError:
                    continue

    threads = [threading.Thread(target=work) for _ in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert int(store.get_bytes("metadata/counter")[0]) == writers * per_writer


# ------------------------------------------------------------------ URLs


def test_open_store_urls(tmp_path: Path) -> None:
    local = open_store(tmp_path / "a")
    assert isinstance(local, LocalStore) and local.root == (tmp_path / "a").absolute()
    assert open_store(f"file://{tmp_path}/b").root == tmp_path / "b"
    assert open_store((tmp_path / "a").as_uri()).url == local.url
    s3 = open_store("s3://bucket/some/prefix/", endpoint_url="http://127.0.0.1:1")
    assert (s3.bucket, s3.prefix, s3.url) == ("bucket", "some/prefix", "s3://bucket/some/prefix")
    assert open_store("s3://bucket", endpoint_url="http://127.0.0.1:1").prefix == ""
    for bad in ("s3://", "gs://bucket/x", "http://host/x", "file://remote/x", "s3://b/p?x=1"):
        with pytest.raises(InvalidStoreURLError) as info:
            open_store(bad)
        assert exit_code_for(info.value) == EXIT_USAGE
    with pytest.raises(InvalidStoreURLError):
        open_store(tmp_path / "missing", create=False)


# ------------------------------------------------------------------ local only


def test_local_writes_leave_no_temporaries(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.put_bytes("metadata/a.json", b"a")
    store.put_object(write(tmp_path / "p", b"payload"))
    with pytest.raises(ConcurrentUpdateError):
        store.put_bytes("metadata/a.json", b"b", if_absent=True)
    leftovers = [p for p in (tmp_path / "s").rglob(".tmp*")]
    assert leftovers == []


def test_local_objects_are_read_only_and_temporaries_are_invisible(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    info = store.put_object(write(tmp_path / "p", b"payload"))
    mode = (tmp_path / "s" / info.key).stat().st_mode & 0o777
    assert mode == 0o444
    # what a crash mid-write leaves: a temporary next to the final name
    stale = tmp_path / "s" / "metadata" / ".tmp-timestamp.json-1-abc"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"half")
    assert [o.key for o in store.list()] == [info.key]
    assert store.remove_stale_temporaries(older_than=-1) == 1
    assert not stale.exists()


def test_local_store_error_on_unwritable_directory(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    store = LocalStore(tmp_path / "s")
    (tmp_path / "s").chmod(0o500)
    try:
        with pytest.raises(StoreError):
            store.put_bytes("metadata/a.json", b"a")
    finally:
        (tmp_path / "s").chmod(0o700)
