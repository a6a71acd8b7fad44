"""``edgepack tuf-client`` speaks the TUF conformance client protocol against a real
``edgepack serve``: init (no request), refresh (unversioned names), download (in order,
not fetched twice), exit 1 on failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

pytest.importorskip("tuf")
pytest.importorskip("fastapi")

from pkgfactory import build_package
from serveproc import ServeProcess

from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import open_store


def tuf_client(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgepack.cli", "tuf-client", *args],
                          capture_output=True, text=True, timeout=120)


def test_init_refresh_download(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = ReleaseRepository(open_store(store), KeyRing(tmp_path / "keys"))
    repo.init()
    build_package(tmp_path / "p.epk", seed=3)
    release = repo.publish(tmp_path / "p.epk", "beta", model="tiny").release
    root = tmp_path / "root.json"
    root.write_bytes((store / "metadata" / "1.root.json").read_bytes())
    meta, targets = tmp_path / "meta", tmp_path / "targets"
    server = ServeProcess(store, tmp_path / "server.log")
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert tuf_client("--metadata-dir", str(meta), "init", str(root)).returncode == 0
        assert sorted(p.name for p in meta.iterdir()) == ["root.json"]
        out = tuf_client("--metadata-dir", str(meta), "--metadata-url", f"{base}/metadata",
                         "refresh")
        assert out.returncode == 0, out.stderr
        assert {"timestamp.json", "snapshot.json", "targets.json"} <= {
            p.name for p in meta.iterdir()}
        args = ["--metadata-dir", str(meta), "--metadata-url", f"{base}/metadata",
                "--target-name", release.path, "--target-base-url", f"{base}/targets",
                "--target-dir", str(targets), "download"]
        out = tuf_client(*args)
        assert out.returncode == 0, out.stderr
        got = targets / quote(release.path, "")
        assert got.read_bytes() == (tmp_path / "p.epk").read_bytes()
        fetched = len(server.access_lines())
        assert [a for a in server.access_lines() if "/targets/" in str(a)]  # the check is live
        assert tuf_client(*args).returncode == 0
        new = server.access_lines()[fetched:]
        assert not [a for a in new if "/targets/" in str(a)], new  # not fetched again
        bad = [*args[:5], "nope/missing.epk", *args[6:]]
        assert tuf_client(*bad).returncode == 1
    finally:
        server.stop()
