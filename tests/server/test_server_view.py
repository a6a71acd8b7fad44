"""The server's view of the repository: bounded staleness, and the last verified state
kept through a store outage."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from pkgfactory import build_package, make_key, replace_header

from edgepack.format import Package
from edgepack.server.errors import RepositoryNotInitializedError, StoreError
from edgepack.server.http.view import ReleaseView
from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.metadata import RepoPolicy
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import open_store


def package(path: Path, version: str) -> Path:
    build_package(path, key=False)
    with Package.open(path) as pkg:
        header = pkg.header
    header = replace(header, identity=replace(header.identity, version=version))
    path.write_bytes(replace_header(path.read_bytes(), header, sign_with=make_key(0)))
    return path


def test_a_publish_is_seen_after_at_most_refresh_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path / "store")
    now = [0.0]
    view = ReleaseView(store, 5.0, clock=lambda: now[0])
    with pytest.raises(RepositoryNotInitializedError):
        view.current()
    repo = ReleaseRepository(store, KeyRing(tmp_path / "keys"))
    repo.init(policy=RepoPolicy(delta_count=0))
    repo.publish(package(tmp_path / "a.epk", "1.0.0"), "beta")
    first = view.current()
    assert [r.version for r in first.index] == ["1.0.0"]
    repo.publish(package(tmp_path / "b.epk", "1.1.0"), "beta")
    now[0] = 4.9
    assert view.current() is first  # within the bound: not re-read
    now[0] = 5.0
    second = view.current()
    assert [r.version for r in second.index] == ["1.0.0", "1.1.0"]
    assert second.timestamp_version == first.timestamp_version + 1
    now[0] = 20.0
    assert view.current() is second  # timestamp.json unchanged: nothing reloaded

    def down(*args: object, **kwargs: object) -> None:
        raise StoreError("connection refused", retriable=True)

    monkeypatch.setattr(store, "get_bytes", down)
    now[0] = 40.0
    assert view.current() is second  # an outage keeps the last verified state
