"""`edgepack serve` as a real subprocess on loopback, for server and client tests."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["ServeProcess", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """One `edgepack serve` subprocess; its stderr (the access log) kept in a file."""

    def __init__(self, store: Path | str, log: Path, *extra: str, ready: bool = True) -> None:
        self.port = free_port()
        self.log = log
        cmd = [sys.executable, "-m", "edgepack.cli", "serve", "--store", str(store)]
        cmd += ["--port", str(self.port), *extra]
        self._err = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._err)
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.get("/readyz" if ready else "/healthz")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        c = self.conn()
        try:
            c.request("GET", path, headers=headers or {})
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def post(self, path: str, body: bytes | Any) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        c = self.conn()
        try:
            c.request("POST", path, body=data, headers={"content-type": "application/json"})
            r = c.getresponse()
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
        finally:
            c.close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()

    def access_lines(self) -> list[dict]:
        out = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out
