"""Benchmark ``edgepack serve`` (issue 12 bars) on loopback.

1. update checks: ``--clients`` (64) concurrent keep-alive clients POST
   ``/v1/update-check`` for ``--seconds`` (20); prints req/s, p50/p99 latency, errors;
2. payloads: ``--downloads`` (16) concurrent ranged downloads of a ``--size-mb`` (100)
   MB package, each fetched as two ranges (the second with ``If-Range``, as a resumed
   download is), from ``edgepack serve`` and, beside it, from nginx (Debian's package,
   ``apt-get install nginx``) serving the same file on loopback; prints MB/s and the
   ratio (the bar: at least 0.5x nginx);
3. one download interrupted at 50% and resumed with ``If-Range``: bytes moved over the
   file size (bar: at most 1.05) and the TUF hash check;
4. ``--redirect``: the same downloads through ``--redirect`` on an S3 store (moto on
   loopback, from the test extra): the 307 answers per second, reported separately
   (the bytes then come from S3, not from us).

    python bench/server.py [--seconds 20] [--clients 64] [--downloads 16]
                           [--size-mb 100] [--workers 1] [--redirect] [--json OUT]

Every request goes to 127.0.0.1; every loop is bounded by count or time.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test package factories

OPS = {"llama.decoder": 2, "matmul.int4_group_sym": 1}


# ----------------------------------------------------------------------- a tiny HTTP/1.1 client


class Conn:
    """One keep-alive connection; every answer of both servers has Content-Length."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        *,
        sink: Any = None,
        stop_after: int | None = None,
    ) -> tuple[int, dict[str, str], int]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body:
            lines += ["content-type: application/json", f"content-length: {len(body)}"]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        assert self.reader is not None
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
        got = {}
        for line in header_lines:
            if ":" in line:
                k, v = line.split(":", 1)
                got[k.strip().lower()] = v.strip()
        length = int(got.get("content-length", "0"))
        read = 0
        while read < length:
            chunk = await self.reader.read(min(1 << 20, length - read))
            if not chunk:
                raise ConnectionError("closed mid-body")
            read += len(chunk)
            if sink is not None:
                sink(chunk)
            if stop_after is not None and read >= stop_after:
                self.close()  # the connection drops mid-body
                return status, got, read
        return status, got, read

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


# ----------------------------------------------------------------------- setup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_store(work: Path, size_mb: int, url: str | None = None) -> dict[str, Any]:
    from pkgfactory import build_package, make_key, replace_header

    from edgepack.format import Package, SectionKind
    from edgepack.server.releases.keys import KeyRing
    from edgepack.server.releases.metadata import RepoPolicy
    from edgepack.server.releases.repository import ReleaseRepository
    from edgepack.server.store import open_store

    pkgs = {}
    pad_kind = int(SectionKind.PREFIX_KV_CACHE)  # a kind that may be large (format.constants)
    for version, pad in (("1.0.0", 1), ("1.1.0", size_mb)):
        path = work / f"tiny-{version}.epk"
        build_package(
            path,
            key=False,
            min_runtime_version="0.2.0",
            required_operators=tuple(OPS.items()),
            extra_sections=[(pad_kind, "pad", os.urandom(pad * 1000 * 1000), False)],
        )
        with Package.open(path) as pkg:
            header = pkg.header
        header = replace(header, identity=replace(header.identity, name="tiny", version=version))
        path.write_bytes(replace_header(path.read_bytes(), header, sign_with=make_key(0)))
        pkgs[version] = path
    store_url = url or str(work / "store")
    repo = ReleaseRepository(open_store(store_url), KeyRing(work / f"keys-{len(store_url)}"))
    repo.init(policy=RepoPolicy(delta_count=0))
    repo.publish(pkgs["1.0.0"], "beta")
    rel = repo.publish(pkgs["1.1.0"], "beta").release
    return {"url": store_url, "release": rel, "v1": pkgs["1.0.0"], "v2": pkgs["1.1.0"]}


def start_server(store_url: str, workers: int, log: Path, *extra: str) -> tuple[Any, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "edgepack.cli", "serve", "--store", store_url,
           "--port", str(port), "--workers", str(workers), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    wait_up(port, proc, "/readyz")
    return proc, port


def wait_up(port: int, proc: Any, path: str) -> None:
    """Until ``path`` answers 200 (HEAD); a 4xx means a broken setup: stop."""
    import http.client

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("HEAD", path)
            status = c.getresponse().status
            c.close()
            if status == 200:
                return
            if 400 <= status < 500:
                proc.terminate()
                raise SystemExit(f"{path} on port {port}: HTTP {status}")
        except OSError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("server did not come up")


def start_nginx(root: Path, name: str, work: Path) -> tuple[Any, int] | None:
    """nginx serving ``root`` (the store's object directory), or None if not installed."""
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if nginx is None:
        return None
    port = free_port()
    conf = work / "nginx.conf"
    conf.write_text(
        f"""daemon off; worker_processes 2; pid {work}/nginx.pid; error_log {work}/nginx.err;
user {getpass.getuser()};
events {{ worker_connections 1024; }}
http {{ access_log off; sendfile on; tcp_nopush on; keepalive_requests 100000;
  client_body_temp_path {work}/nb; proxy_temp_path {work}/np; fastcgi_temp_path {work}/nf;
  uwsgi_temp_path {work}/nu; scgi_temp_path {work}/ns;
  server {{ listen 127.0.0.1:{port}; root {root}; }} }}
"""
    )
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(work)], stderr=subprocess.DEVNULL)
    wait_up(port, proc, f"/{name}")
    return proc, port


# ----------------------------------------------------------------------- phases


def check_body(i: int) -> bytes:
    return json.dumps({
        "device_id": f"bench-{i}", "installed_sha256": None, "runtime_version": "0.2.0",
        "operator_set_version": 1, "operators": OPS, "channel": "beta", "model": "tiny",
        "adapters": [], "free_bytes": 1 << 40,
    }).encode()


async def update_checks(port: int, clients: int, seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds

    async def client(i: int) -> None:
        nonlocal errors
        conn, body = Conn(port), check_body(i)
        try:
            while time.monotonic() < deadline:
                t = time.perf_counter()
                try:
                    status, _, _ = await conn.request("POST", "/v1/update-check", body)
                except (OSError, asyncio.IncompleteReadError):
                    errors += 1
                    conn.close()
                    continue
                latencies.append(time.perf_counter() - t)
                errors += status != 200
        finally:
            conn.close()

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.monotonic() - started
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [0.0] * 99
    return {
        "requests": len(latencies),
        "req_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
        "errors": errors,
    }


async def ranged_downloads(port: int, path: str, size: int, n: int, etag: str | None):
    """n concurrent clients, each the whole file as two ranges (If-Range on the second)."""
    half = size // 2

    async def one() -> int:
        conn = Conn(port)
        try:
            s1, h1, a = await conn.request("GET", path, headers={"range": f"bytes=0-{half - 1}"})
            tag = etag or h1.get("etag", "")
            s2, _, b = await conn.request(
                "GET", path, headers={"range": f"bytes={half}-", "if-range": tag}
            )
            if (s1, s2) != (206, 206) or a + b != size:
                raise RuntimeError(f"ranged download: {s1} {s2} {a + b}/{size}")
            return a + b
        finally:
            conn.close()

    started = time.monotonic()
    total = sum(await asyncio.gather(*(one() for _ in range(n))))
    elapsed = time.monotonic() - started
    return {"clients": n, "mb_per_s": round(total / elapsed / 1e6, 1), "seconds": round(elapsed, 2)}


async def interrupted_resume(port: int, path: str, size: int, sha256: str) -> dict[str, Any]:
    digest = hashlib.sha256()
    conn = Conn(port)
    _, headers, got = await conn.request("GET", path, sink=digest.update, stop_after=size // 2)
    moved = got
    status, _, rest = await conn.request(
        "GET", path, headers={"range": f"bytes={got}-", "if-range": headers["etag"]},
        sink=digest.update,
    )
    conn.close()
    moved += rest
    return {
        "resume_status": status,
        "moved_over_size": round(moved / size, 4),
        "hash_ok": digest.hexdigest() == sha256,
    }


async def redirects(port: int, path: str, clients: int, seconds: float) -> dict[str, Any]:
    count, errors = 0, 0
    deadline = time.monotonic() + seconds

    async def client() -> None:
        nonlocal count, errors
        conn = Conn(port)
        while time.monotonic() < deadline:
            status, _, _ = await conn.request("GET", path)
            count += 1
            errors += status != 307
        conn.close()

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    return {"redirects_per_s": round(count / (time.monotonic() - started), 1), "errors": errors}


# ----------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--downloads", type=int, default=16)
    ap.add_argument("--size-mb", type=int, default=100)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--redirect", action="store_true", help="also measure --redirect on S3")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="edgepack-bench-server-") as tmp:
        work = Path(tmp)
        world = make_store(work, args.size_mb)
        rel = world["release"]
        proc, port = start_server(world["url"], args.workers, work / "serve.log")
        try:
            out["update_check"] = asyncio.run(update_checks(port, args.clients, args.seconds))
            print(f"update-check, {args.clients} clients, {args.seconds:g} s: "
                  f"{out['update_check']}")
            path = f"/targets/{rel.path}"
            ours = asyncio.run(ranged_downloads(port, path, rel.length, args.downloads, None))
            out["downloads_edgepack"] = ours
            print(f"{args.downloads} ranged downloads of {rel.length / 1e6:.0f} MB, edgepack: "
                  f"{ours}")
            out["resume"] = asyncio.run(interrupted_resume(port, path, rel.length, rel.sha256))
            print(f"interrupted at 50% and resumed with If-Range: {out['resume']}")
        finally:
            proc.terminate()
            proc.wait(30)
        nginx = start_nginx(Path(world["url"]) / "objects" / "sha256", rel.sha256, work)
        if nginx is None:
            print("nginx: not installed (apt-get install nginx), no side-by-side figure")
        else:
            nproc, nport = nginx
            try:
                theirs = asyncio.run(
                    ranged_downloads(nport, f"/{rel.sha256}", rel.length, args.downloads, None)
                )
            finally:
                nproc.terminate()
                nproc.wait(30)
            out["downloads_nginx"] = theirs
            ratio = ours["mb_per_s"] / theirs["mb_per_s"]
            out["ratio_vs_nginx"] = round(ratio, 3)
            print(f"same downloads, nginx: {theirs}; edgepack/nginx = {ratio:.2f}x")
        if args.redirect:
            out["redirect"] = bench_redirect(work, args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


def bench_redirect(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from s3server import MotoServer

    with MotoServer() as s3:
        os.environ.update(s3.env())
        s3.create_bucket("bench")
        (work / "s3").mkdir()
        world = make_store(work / "s3", min(args.size_mb, 8), url="s3://bench/serve")
        proc, port = start_server(world["url"], args.workers, work / "redirect.log", "--redirect")
        try:
            path = f"/targets/{world['release'].path}"
            result = asyncio.run(redirects(port, path, args.downloads, min(args.seconds, 5)))
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"--redirect (307 to a presigned S3 URL), {args.downloads} clients: {result}")
    return result


if __name__ == "__main__":
    sys.exit(main())
