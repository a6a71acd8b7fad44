"""A real S3 API server on loopback for tests: moto in server mode, in a subprocess.

Not the in-process mock: requests go through botocore, HTTP and a socket, like they
would against S3 or MinIO, and the server outlives any client process the tests kill.

    with MotoServer() as server:
        env = server.env()          # AWS_ENDPOINT_URL and dummy credentials
        server.create_bucket("models")

As a pytest fixture: ``s3_server`` (session scoped) below, imported by test modules
with ``from s3server import s3_server  # noqa: F401``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

__all__ = ["MotoServer", "s3_server"]

_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """Start/stop ``python -m moto.server`` on 127.0.0.1 and a free port."""

    def __init__(self, *, startup_timeout: float = 30.0) -> None:
        self.startup_timeout = startup_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._client = None
        self._log = None
        self._buckets: set[str] = set()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        last_error = ""
        for _ in range(3):  # the free port can be taken between probe and bind
            self.port = _free_port()
            # the server logs every request: a file, never a pipe nobody drains (a full
            # pipe blocks the server)
            self._log = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=self._log,
                env={**os.environ, **_CREDENTIALS},
            )
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    self._log.seek(0)
                    last_error = self._log.read().decode(errors="replace")[-500:]
                    self._log.close()
                    break
                try:
                    with urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=1):
                        return self
                except (urllib.error.URLError, ConnectionError, OSError):
                    time.sleep(0.05)
            else:
                self.stop()
                raise RuntimeError("moto server did not start in time")
        raise RuntimeError(f"moto server failed to start: {last_error}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None

    def reset(self) -> None:
        """Forget every bucket and object."""
        req = urllib.request.Request(self.endpoint_url + "/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass
        self._buckets.clear()

    def env(self) -> dict[str, str]:
        """Environment for a client process (boto3 reads AWS_ENDPOINT_URL itself)."""
        return {**_CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint_url}

    def client(self):
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def _make_client(self):
        import boto3

        return boto3.session.Session(
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            aws_session_token="testing",
            region_name="us-east-1",
        ).client("s3", endpoint_url=self.endpoint_url)

    def create_bucket(self, name: str) -> None:
        if name in self._buckets:
            return
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)
        self._buckets.add(name)

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoServer]:
    """One moto server for the session, with its endpoint and credentials in os.environ
    (restored afterwards) so S3 stores opened by the tests find it."""
    server = MotoServer().start()
    saved = {k: os.environ.get(k) for k in [*server.env(), "AWS_PROFILE"]}
    os.environ.update(server.env())
    os.environ.pop("AWS_PROFILE", None)
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
