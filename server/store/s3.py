"""S3 (and any S3-compatible endpoint) through boto3.

* Endpoint and credentials come from the usual AWS environment and config files;
  ``endpoint_url`` (``--endpoint-url``) or ``AWS_ENDPOINT_URL[_S3]`` point it at
  MinIO, Ceph, moto...; a custom endpoint uses path-style addressing unless
  ``EDGEPACK_S3_ADDRESSING_STYLE`` says otherwise.
* Payloads above ``multipart_threshold`` go up as an explicit multipart upload, parts
  in parallel, each with its own SHA-256 checksum that S3 verifies on receipt; the
  object is checked after completion against the composite checksum computed locally
  (single PUTs against the full SHA-256), so what landed is what was hashed.
  An interrupted multipart upload is invisible (and aborted when possible); what a
  killed process left is aborted by the next publish once no part has landed for an
  hour (:meth:`Store.remove_stale_temporaries`; a live upload lands a part every few
  seconds), and listed or aborted by ``edgepack repo gc``.
* Retries: botocore's own (``standard`` mode) plus an outer loop with exponential
  backoff and jitter for idempotent calls and for ranged GETs interrupted mid-stream,
  which resume where they stopped (pinned to the ETag first seen).
* Conditional writes use S3's ``If-None-Match: *`` / ``If-Match: <etag>``; a retried
  conditional write that finds its own bytes in place counts as a success.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from edgepack.format.output_file import STALE_AGE_SECONDS

from ..errors import ConcurrentUpdateError, ObjectNotFoundError, StoreError
from .base import CHUNK_SIZE, OBJECTS_PREFIX, ObjectInfo, PendingUpload, Store, check_key

__all__ = ["S3Store"]

T = TypeVar("T")

MIN_PART_SIZE = 5 * 1024 * 1024  # S3's rule for every part but the last
MAX_PARTS = 10_000
_RETRIABLE_CODES = {
    "InternalError",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "ServiceUnavailable",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "500",
    "502",
    "503",
    "504",
}
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise StoreError(f"{name}={value!r} is not an integer") from None


class S3Store(Store):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        multipart_threshold: int | None = None,
        part_size: int | None = None,
        max_concurrency: int = 4,
        max_attempts: int = 5,
        backoff_base: float = 0.2,
        backoff_cap: float = 8.0,
        client: Any = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.part_size = part_size or _env_int("EDGEPACK_S3_PART_SIZE", 16 * 1024 * 1024)
        self.multipart_threshold = multipart_threshold or _env_int(
            "EDGEPACK_S3_MULTIPART_THRESHOLD", 32 * 1024 * 1024
        )
        if self.part_size < MIN_PART_SIZE:
            raise ValueError(f"S3 parts must be at least {MIN_PART_SIZE} bytes")
        self.max_concurrency = max(1, max_concurrency)
        self.max_attempts = max(1, max_attempts)
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.endpoint_url = (
            endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        self._region = region
        self._client_obj = client

    @property
    def _client(self) -> Any:
        """The boto3 client, created on first use (creating one costs ~0.5 s)."""
        if self._client_obj is None:
            self._client_obj = self._make_client(self._region)
        return self._client_obj

    def _make_client(self, region: str | None) -> Any:
        try:
            from botocore.config import Config
        except ImportError:
            raise StoreError("s3:// stores need boto3: pip install 'edgepack[server]'") from None
        session = _session()
        style = os.environ.get("EDGEPACK_S3_ADDRESSING_STYLE") or (
            "path" if self.endpoint_url else "auto"
        )
        config = Config(
            retries={"max_attempts": 3, "mode": "standard"},
            s3={"addressing_style": style},
            connect_timeout=10,
            read_timeout=60,
            max_pool_connections=max(10, self.max_concurrency * 2),
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return session.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=region or session.region_name or "us-east-1",
            config=config,
        )

    # -- keys ------------------------------------------------------------------------
    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- error handling and retries -------------------------------------------------------
    def _translate(self, exc: BaseException, key: str | None) -> StoreError:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionError,
            HTTPClientError,
            NoCredentialsError,
        )

        where = f"{self.url}: {key}" if key else self.url
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            msg = err.get("Message") or code
            if code in _CONFLICT_CODES or status in ("412", "409"):
                return ConcurrentUpdateError(f"{where}: condition failed ({code})", key=key)
            if code in _NOT_FOUND_CODES or status == "404":
                if code == "NoSuchBucket":
                    return StoreError(f"bucket {self.bucket!r} does not exist", key=key)
                return ObjectNotFoundError(f"{where}: no such object", key=key)
            if code == "NoSuchBucket":
                return StoreError(f"bucket {self.bucket!r} does not exist", key=key)
            retriable = code in _RETRIABLE_CODES or status in _RETRIABLE_CODES
            return StoreError(f"{where}: {code}: {msg}", retriable=retriable, key=key)
        if isinstance(exc, NoCredentialsError):
            return StoreError(
                "no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                "AWS_PROFILE)"
            )
        if isinstance(exc, ConnectionError | HTTPClientError):
            return StoreError(f"{where}: {exc}", retriable=True, key=key)
        if isinstance(exc, BotoCoreError):
            return StoreError(f"{where}: {exc}", key=key)
        if isinstance(exc, OSError):
            return StoreError(f"{where}: {exc}", retriable=True, key=key)
        raise exc

    def _retry(self, fn: Callable[[], T], key: str | None, *, idempotent: bool = True) -> T:
        """Run ``fn``; retry retriable failures with exponential backoff and jitter."""
        attempts = self.max_attempts if idempotent else 1
        for attempt in range(attempts):
            try:
                return fn()
            except StoreError:
                raise
            except Exception as exc:
                err = self._translate(exc, key)
                if (
                    not err.retriable
                    or attempt + 1 >= attempts
                    or isinstance(err, ConcurrentUpdateError)
                ):
                    raise err from None
                self._sleep(attempt)
        raise AssertionError("unreachable")

    def _sleep(self, attempt: int) -> None:
        delay = min(self.backoff_cap, self.backoff_base * (2**attempt))
        time.sleep(delay * (0.5 + random.random() / 2))

    # -- reads ---------------------------------------------------------------------------
    def stat(self, key: str) -> ObjectInfo | None:
        full = self._full(key)

        def head() -> dict[str, Any]:
            return self._client.head_object(Bucket=self.bucket, Key=full)

        try:
            resp = self._retry(head, key)
        except ObjectNotFoundError:
            return None
        sha = resp.get("Metadata", {}).get("sha256")
        if sha is None and key.startswith(OBJECTS_PREFIX):
            sha = key[len(OBJECTS_PREFIX) :]
        when = resp.get("LastModified")
        return ObjectInfo(
            key, int(resp["ContentLength"]), resp.get("ETag", ""), sha, when and when.timestamp()
        )

    def iter_bytes(
        self, key: str, start: int = 0, length: int | None = None, chunk_size: int = CHUNK_SIZE
    ) -> Iterator[bytes]:
        if start < 0 or (length is not None and length < 0):
            raise ValueError("negative range")
        full = self._full(key)
        end = None if length is None else start + length  # exclusive
        if end is not None and end == start:
            self.require(key)
            return iter(())
        first = self._open_range(full, key, start, end, None)
        return self._stream(full, key, start, end, first, chunk_size)

    def _open_range(
        self, full: str, key: str, start: int, end: int | None, etag: str | None
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-" + ("" if end is None else str(end - 1))
        if etag:
            kwargs["IfMatch"] = etag
        try:
            return self._retry(lambda: self._client.get_object(**kwargs), key)
        except StoreError as exc:
            if "InvalidRange" in str(exc):
                return {"Body": None, "ETag": etag or ""}
            raise

    def _stream(
        self,
        full: str,
        key: str,
        start: int,
        end: int | None,
        resp: dict[str, Any],
        chunk_size: int,
    ) -> Iterator[bytes]:
        pos, etag, failures = start, resp.get("ETag"), 0
        while True:
            body = resp.get("Body")
            if body is None:
                return
            try:
                for chunk in body.iter_chunks(chunk_size):
                    if chunk:
                        pos += len(chunk)
                        yield chunk
                if end is not None and pos < end:
                    raise OSError(f"short read at byte {pos}")
                return
            except Exception as exc:
                err = self._translate(exc, key)
                failures += 1
                if not err.retriable or failures >= self.max_attempts:
                    raise err from None
                self._sleep(failures - 1)
                resp = self._open_range(full, key, pos, end, etag)
            finally:
                body.close()

    def get_bytes(self, key: str, *, max_length: int = 16 * 1024 * 1024) -> tuple[bytes, str]:
        full = self._full(key)

        def get() -> tuple[bytes, str]:
            resp = self._client.get_object(Bucket=self.bucket, Key=full)
            if int(resp.get("ContentLength", 0)) > max_length:
                resp["Body"].close()
                raise StoreError(f"{key} is larger than {max_length} bytes", key=key)
            return resp["Body"].read(), resp.get("ETag", "")

        return self._retry(get, key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._retry(lambda kw=kwargs: self._client.list_objects_v2(**kw), prefix)
            for item in page.get("Contents", []):
                key = item["Key"][strip:]
                sha = key[len(OBJECTS_PREFIX) :] if key.startswith(OBJECTS_PREFIX) else None
                when = item.get("LastModified")
                yield ObjectInfo(
                    key, int(item["Size"]), item.get("ETag", ""), sha, when and when.timestamp()
                )
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    # -- writes ------------------------------------------------------------------------
    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        if_absent: bool = False,
        if_match: str | None = None,
        content_type: str = "application/octet-stream",
    ) -> str:
        if if_absent and if_match is not None:
            raise ValueError("if_absent and if_match are exclusive")
        full = self._full(key)
        sha = hashlib.sha256(data).hexdigest()
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": full,
            "Body": data,
            "ContentType": content_type,
            "ChecksumAlgorithm": "SHA256",
            "ChecksumSHA256": _b64(hashlib.sha256(data).digest()),
            "Metadata": {"sha256": sha},
        }
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        for attempt in range(self.max_attempts):
            try:
                return self._client.put_object(**kwargs)["ETag"]
            except Exception as exc:
                err = self._translate(exc, key)
                if if_match is not None and isinstance(err, ObjectNotFoundError):
                    err = ConcurrentUpdateError(f"{self.url}: {key} was deleted", key=key)
                if isinstance(err, ConcurrentUpdateError) and attempt > 0:
                    # an earlier attempt may have landed before its response was lost
                    landed = self.stat(key)
                    if landed is not None and landed.sha256 == sha:
                        return landed.etag
                if not err.retriable or isinstance(err, ConcurrentUpdateError):
                    raise err from None
                if attempt + 1 >= self.max_attempts:
                    raise err from None
                self._sleep(attempt)
        raise AssertionError("unreachable")

    def _put_object_file(self, path: Path, key: str, sha256_hex: str, size: int) -> None:
        full = self._full(key)
        if size < self.multipart_threshold:
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != sha256_hex:
                raise StoreError(f"{path} changed while it was being stored", key=key)
            digest_b64 = _b64(bytes.fromhex(sha256_hex))

            def put() -> None:
                self._client.put_object(
                    Bucket=self.bucket,
                    Key=full,
                    Body=data,
                    ChecksumAlgorithm="SHA256",
                    ChecksumSHA256=digest_b64,
                    Metadata={"sha256": sha256_hex},
                )

            self._retry(put, key)
            self._verify_checksum(key, digest_b64)
        else:
            composite = self._multipart(path, full, key, sha256_hex, size)
            self._verify_checksum(key, composite)

    def _multipart(self, path: Path, full: str, key: str, sha256_hex: str, size: int) -> str:
        part_size = max(self.part_size, -(-size // MAX_PARTS))
        # one local pass for the part digests, checked against the hash the key names:
        # every part sent later must match its digest, so the object is those bytes
        digests: list[bytes] = []
        whole = hashlib.sha256()
        with open(path, "rb") as f:
            while data := f.read(part_size):
                whole.update(data)
                digests.append(hashlib.sha256(data).digest())
        if whole.hexdigest() != sha256_hex or len(digests) != -(-size // part_size):
            raise StoreError(f"{path} changed while it was being stored", key=key)
        created = self._retry(
            lambda: self._client.create_multipart_upload(
                Bucket=self.bucket,
                Key=full,
                ChecksumAlgorithm="SHA256",
                Metadata={"sha256": sha256_hex},
            ),
            key,
        )
        upload_id = created["UploadId"]

        def send(number: int) -> dict[str, Any]:
            offset = (number - 1) * part_size
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(min(part_size, size - offset))
            digest = hashlib.sha256(data).digest()
            if digest != digests[number - 1]:
                raise StoreError(f"{path} changed while it was being stored", key=key)
            checksum = _b64(digest)
            resp = self._retry(
                lambda: self._client.upload_part(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data,
                    ChecksumSHA256=checksum,
                ),
                key,
            )
            return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumSHA256": checksum}

        try:
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(digests))) as pool:
                parts = list(pool.map(send, range(1, len(digests) + 1)))
            self._complete(full, key, upload_id, parts, size)
        except BaseException:
            try:
                self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id
                )
            except Exception:
                pass  # the upload stays invisible; abort_stale_uploads clears it later
            raise
        composite = hashlib.sha256(b"".join(digests)).digest()
        return f"{_b64(composite)}-{len(digests)}"

    def _complete(
        self, full: str, key: str, upload_id: str, parts: list[dict[str, Any]], size: int
    ) -> None:
        for attempt in range(self.max_attempts):
            try:
                self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
                return
            except Exception as exc:
                err = self._translate(exc, key)
                if attempt > 0 and "NoSuchUpload" in str(err):
                    # a lost response to a completion that succeeded
                    landed = self.stat(key)
                    if landed is not None and landed.size == size:
                        return
                if not err.retriable or attempt + 1 >= self.max_attempts:
                    raise err from None
                self._sleep(attempt)

    def _verify_checksum(self, key: str, expected: str) -> None:
        """Check the server-side SHA-256 (full or composite) of what landed."""
        full = self._full(key)
        resp = self._retry(
            lambda: self._client.head_object(Bucket=self.bucket, Key=full, ChecksumMode="ENABLED"),
            key,
        )
        got = resp.get("ChecksumSHA256")
        if got is None:
            return  # endpoint without checksum support: size and metadata are checked
        if got != expected and got.split("-")[0] != expected.split("-")[0]:
            raise StoreError(
                f"{key}: server checksum {got} does not match the uploaded bytes ({expected})",
                retriable=True,
                key=key,
            )

    def delete(self, key: str) -> None:
        full = self._full(key)
        self._retry(lambda: self._client.delete_object(Bucket=self.bucket, Key=full), key)

    def touch(self, key: str) -> None:
        """Copy the object onto itself (same bytes and metadata) for a new LastModified."""
        full = self._full(key)
        head = self._retry(lambda: self._client.head_object(Bucket=self.bucket, Key=full), key)
        self._retry(
            lambda: self._client.copy_object(
                Bucket=self.bucket,
                Key=full,
                CopySource={"Bucket": self.bucket, "Key": full},
                MetadataDirective="REPLACE",
                Metadata=head.get("Metadata", {}),
                ContentType=head.get("ContentType", "application/octet-stream"),
            ),
            key,
        )

    def remove_stale_temporaries(self, older_than: float | None = None) -> int:
        """Abort the multipart uploads a killed publisher left: those idle for
        ``older_than`` seconds (default ``EDGEPACK_S3_STALE_UPLOAD_SECONDS``, an hour);
        return how many."""
        if older_than is None:
            older_than = _env_int("EDGEPACK_S3_STALE_UPLOAD_SECONDS", int(STALE_AGE_SECONDS))
        return len(self.abort_idle_uploads(older_than))

    def abort_stale_uploads(self, older_than: float | None = None) -> int:
        """The S3 name of :meth:`remove_stale_temporaries`."""
        return self.remove_stale_temporaries(older_than)

    def pending_uploads(self) -> list[PendingUpload]:
        """Incomplete multipart uploads of this store's objects (only ``objects/``: a
        bucket shared with other software keeps its own uploads), with their parts'
        sizes and newest time."""
        prefix = self._full(OBJECTS_PREFIX.rstrip("/")) + "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        found: list[PendingUpload] = []
        markers: dict[str, str] = {}
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, **markers}
            page = self._retry(lambda kw=kwargs: self._client.list_multipart_uploads(**kw), None)
            for up in page.get("Uploads", []):
                started = up["Initiated"].timestamp()
                size, newest = self._parts(up["Key"], up["UploadId"])
                found.append(
                    PendingUpload(
                        up["Key"][strip:], up["UploadId"], started, max(started, newest), size
                    )
                )
            if not page.get("IsTruncated"):
                return found
            markers = {
                "KeyMarker": page.get("NextKeyMarker", ""),
                "UploadIdMarker": page.get("NextUploadIdMarker", ""),
            }

    def _parts(self, full: str, upload_id: str) -> tuple[int, float]:
        """(bytes, newest part's POSIX time or 0) of an incomplete upload."""
        size, newest, marker = 0, 0.0, 0
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "UploadId": upload_id}
            if marker:
                kwargs["PartNumberMarker"] = marker
            try:
                page = self._retry(lambda kw=kwargs: self._client.list_parts(**kw), None)
            except StoreError as exc:
                if "NoSuchUpload" in str(exc):
                    return size, time.time()  # completed or aborted meanwhile: not idle
                raise
            for part in page.get("Parts", []):
                size += int(part.get("Size", 0))
                when = part.get("LastModified")
                newest = max(newest, when.timestamp() if when else 0.0)
            if not page.get("IsTruncated"):
                return size, newest
            marker = int(page.get("NextPartNumberMarker") or 0)

    def abort_upload(self, upload: PendingUpload) -> None:
        full = self._full(upload.key)
        try:
            self._retry(
                lambda: self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload.upload_id
                ),
                upload.key,
            )
        except StoreError as exc:
            if "NoSuchUpload" not in str(exc):
                raise  # gone already (completed or aborted by another run): nothing to do

    def create_bucket(self) -> None:
        """Create the bucket (tests and first-time setup); existing buckets are fine."""
        try:
            self._client.create_bucket(Bucket=self.bucket)
        except Exception as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._translate(exc, None) from None

    def close(self) -> None:
        close = getattr(self._client_obj, "close", None)
        if close is not None:
            close()
        self._client_obj = None


_SESSIONS: dict[tuple[str | None, ...], Any] = {}
_SESSIONS_LOCK = threading.Lock()
_SESSION_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)


def _session() -> Any:
    """One boto3 session per AWS environment: loading botocore's data is the slow part
    of making a client, and a session caches it."""
    try:
        import boto3
    except ImportError:
        raise StoreError("s3:// stores need boto3: pip install 'edgepack[server]'") from None
    env = tuple(os.environ.get(k) for k in _SESSION_ENV)
    with _SESSIONS_LOCK:
        session = _SESSIONS.get(env)
        if session is None:
            session = _SESSIONS[env] = boto3.session.Session()
        return session


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")
