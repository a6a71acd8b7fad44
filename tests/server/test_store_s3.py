"""S3 backend details against a real S3 API (moto server on loopback): multipart uploads
with per-part checksums, server-side verification, retries and resumed reads under
injected faults, leftovers of killed uploads."""

from __future__ import annotations

import base64
import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError
from s3server import MotoServer, s3_server  # noqa: F401

from edgepack.server.errors import ConcurrentUpdateError, StoreError
from edgepack.server.store import open_store
from edgepack.server.store.s3 import S3Store

BUCKET = "edgepack-s3-tests"
MiB = 1024 * 1024


@pytest.fixture
def server(s3_server: MotoServer) -> MotoServer:  # noqa: F811
    s3_server.create_bucket(BUCKET)
    return s3_server


def new_store(**options: Any) -> S3Store:
    store = open_store(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", **options)
    assert isinstance(store, S3Store)
    return store


class Flaky:
    """A boto3 client proxy that injects failures: ``plan[method]`` is a list of
    ``("before" | "after", exception)``; "after" performs the call, then raises (a lost
    response)."""

    def __init__(self, real: Any, plan: dict[str, list[tuple[str, Exception]]]) -> None:
        self.real, self.plan, self.calls = real, plan, []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.real, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if self.plan.get(name):
                when, exc = self.plan[name].pop(0)
                if when == "after":
                    fn(*args, **kwargs)
                raise exc
            return fn(*args, **kwargs)

        return call


def slow_down(op: str) -> ClientError:
    return ClientError(
        {
            "Error": {"Code": "SlowDown", "Message": "slow"},
            "ResponseMetadata": {"HTTPStatusCode": 503},
        },
        op,
    )


def test_multipart_upload_with_part_checksums(server: MotoServer, tmp_path: Path) -> None:
    data = os.urandom(11 * MiB + 123)  # > 8 MiB, three 5 MiB parts
    src = tmp_path / "big.epk"
    src.write_bytes(data)
    store = new_store(part_size=5 * MiB, multipart_threshold=8 * MiB, max_concurrency=3)
    info = store.put_object(src)
    assert info.size == len(data) and info.sha256 == hashlib.sha256(data).hexdigest()
    client = server.client()
    full = f"{store.prefix}/{info.key}"
    head = client.head_object(Bucket=BUCKET, Key=full, PartNumber=1)
    assert head["PartsCount"] == 3
    parts = [data[i : i + 5 * MiB] for i in range(0, len(data), 5 * MiB)]
    composite = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in parts)).digest()
    checksum = client.head_object(Bucket=BUCKET, Key=full, ChecksumMode="ENABLED")["ChecksumSHA256"]
    assert checksum.split("-")[0] == base64.b64encode(composite).decode()
    assert client.head_object(Bucket=BUCKET, Key=full)["Metadata"]["sha256"] == info.sha256
    # a range across the first part boundary
    assert store.read_range(info.key, 5 * MiB - 10, 20) == data[5 * MiB - 10 : 5 * MiB + 10]
    assert store.download(info.key, tmp_path / "copy").read_bytes() == data
    # idempotent: a second put of the same content uploads nothing
    calls_before = len(client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []))
    assert store.put_object(src).key == info.key
    assert len(client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])) == calls_before


def test_single_put_is_checked_against_the_full_sha256(server: MotoServer, tmp_path: Path) -> None:
    data = os.urandom(100_000)
    (tmp_path / "p").write_bytes(data)
    store = new_store()
    info = store.put_object(tmp_path / "p")
    resp = server.client().head_object(
        Bucket=BUCKET, Key=f"{store.prefix}/{info.key}", ChecksumMode="ENABLED"
    )
    assert resp["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(data).digest()).decode()


def test_failed_multipart_is_aborted_and_invisible(server: MotoServer, tmp_path: Path) -> None:
    src = tmp_path / "big"
    src.write_bytes(os.urandom(11 * MiB))
    store = new_store(part_size=5 * MiB, multipart_threshold=8 * MiB, max_concurrency=1)
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "UploadPart")
    store._client_obj = Flaky(server.client(), {"upload_part": [("before", denied)]})
    with pytest.raises(StoreError, match="AccessDenied") as info:
        store.put_object(src)
    assert not info.value.retriable
    assert list(store.list()) == []
    uploads = server.client().list_multipart_uploads(Bucket=BUCKET, Prefix=store.prefix + "/")
    assert uploads.get("Uploads", []) == []


def test_abort_stale_uploads(server: MotoServer) -> None:
    """What a SIGKILLed publisher leaves: an incomplete multipart upload, invisible."""
    store = new_store()
    client = server.client()
    client.create_multipart_upload(Bucket=BUCKET, Key=f"{store.prefix}/objects/sha256/{'a' * 64}")
    assert list(store.list()) == []
    assert store.abort_stale_uploads(older_than=0) == 1
    assert (
        client.list_multipart_uploads(Bucket=BUCKET, Prefix=store.prefix).get("Uploads", []) == []
    )


def test_retries_with_backoff(server: MotoServer, tmp_path: Path) -> None:
    store = new_store(backoff_base=0.001)
    flaky = Flaky(
        server.client(),
        {
            "put_object": [("before", slow_down("PutObject"))],
            "head_object": [("before", EndpointConnectionError(endpoint_url="x"))],
            "get_object": [("before", slow_down("GetObject"))],
        },
    )
    store._client_obj = flaky
    (tmp_path / "p").write_bytes(b"payload" * 1000)
    info = store.put_object(tmp_path / "p")
    assert store.get_bytes(info.key)[0] == b"payload" * 1000
    assert flaky.calls.count("put_object") == 2 and flaky.calls.count("get_object") == 2


def test_retries_give_up_and_say_so(server: MotoServer) -> None:
    store = new_store(backoff_base=0.001, max_attempts=3)
    store._client_obj = Flaky(
        server.client(), {"get_object": [("before", slow_down("GetObject"))] * 3}
    )
    with pytest.raises(StoreError, match="SlowDown") as info:
        store.get_bytes("metadata/x.json")
    assert info.value.retriable


def test_read_resumes_after_a_dropped_connection(server: MotoServer, tmp_path: Path) -> None:
    data = os.urandom(3 * MiB)
    (tmp_path / "p").write_bytes(data)
    store = new_store(backoff_base=0.001)
    key = store.put_object(tmp_path / "p").key
    real = server.client()
    ranges: list[str | None] = []

    class DropAfterFirstChunk:
        def __init__(self, body: Any) -> None:
            self.body = body

        def iter_chunks(self, size: int):
            it = self.body.iter_chunks(size)
            yield next(it)
            raise ReadTimeoutError(endpoint_url="x")

        def close(self) -> None:
            self.body.close()

    class Client:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def get_object(self, **kw: Any) -> Any:
            ranges.append(kw.get("Range"))
            resp = real.get_object(**kw)
            if len(ranges) == 1:
                resp["Body"] = DropAfterFirstChunk(resp["Body"])
            return resp

    store._client_obj = Client()
    assert b"".join(store.iter_bytes(key, chunk_size=MiB)) == data
    assert ranges == [None, f"bytes={MiB}-"]  # resumed where it stopped


def test_conditional_write_with_a_lost_response(server: MotoServer) -> None:
    """The first PUT lands but its response is lost; the retry hits the condition and
    finds its own bytes: a success, not a conflict."""
    store = new_store(backoff_base=0.001)
    store._client_obj = Flaky(
        server.client(), {"put_object": [("after", EndpointConnectionError(endpoint_url="x"))]}
    )
    store.put_bytes("metadata/2.targets.json", b"mine", if_absent=True)
    assert store.get_bytes("metadata/2.targets.json")[0] == b"mine"
    with pytest.raises(ConcurrentUpdateError):  # someone else's bytes are a real conflict
        store.put_bytes("metadata/2.targets.json", b"theirs", if_absent=True)


def test_prefixes_are_isolated_and_missing_bucket_is_clear(server: MotoServer) -> None:
    a, b = new_store(), new_store()
    a.put_bytes("metadata/root.json", b"a")
    assert list(b.list()) == [] and b.stat("metadata/root.json") is None
    missing = open_store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x")
    with pytest.raises(StoreError, match="does not exist") as info:
        missing.put_bytes("metadata/root.json", b"x")
    assert not info.value.retriable
