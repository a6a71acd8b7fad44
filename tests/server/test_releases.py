"""Release repository: TUF metadata built by edgepack, read by python-tuf's own client.

Every flow ends with ``tuf.ngclient.Updater`` (through StoreFetcher, straight from the
store) refreshing and downloading, so "it verifies" means "a stock TUF client accepts
it" - and "it is refused" means the stock client refuses it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import shutil
import sys
import types
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pkgfactory import build_package, make_key, replace_header
from s3server import MotoServer, s3_server  # noqa: F401
from tuf.api import exceptions as tuf_exc
from tuf.api.metadata import Metadata, Timestamp
from tuf.ngclient import Updater

from edgepack.cli import main as cli_main
from edgepack.cli.exit_codes import EXIT_CORRUPT, EXIT_SIGNATURE, EXIT_USAGE, exit_code_for
from edgepack.format import (
    CorruptPackageError,
    Package,
    RuntimeCapabilities,
    SignatureError,
)
from edgepack.server.errors import (
    ConcurrentUpdateError,
    ExpiredMetadataError,
    MetadataSignatureError,
    MissingKeyError,
    ReleasePolicyError,
    RepositoryError,
    RepositoryExistsError,
    RepositoryNotInitializedError,
    RollbackError,
    UnknownReleaseError,
    VersionConflictError,
    VersionNotIncreasingError,
)
from edgepack.server.releases import deltas as deltas_mod
from edgepack.server.releases.fetcher import (
    METADATA_URL,
    TARGETS_URL,
    StoreFetcher,
    map_tuf_error,
    target_object_key,
)
from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.metadata import RepoPolicy, serialize, sign
from edgepack.server.releases.model import (
    ReleaseIndex,
    ReleaseInfo,
    Requirements,
    in_rollout,
    semver_precedence,
)
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import Store, open_store

OPS = (("llama.decoder", 2), ("matmul.int4_group_sym", 1))


# ----------------------------------------------------------------------- helpers


def make_pkg(
    path: Path,
    version: str,
    *,
    seed: int = 0,
    name: str = "tiny-llama",
    key: Any = True,
    min_runtime_version: str = "0.2.0",
    pad: bytes = b"",
) -> Path:
    """A small real package with the given model name/version (pkgfactory underneath)."""
    extra = [(8, "pad", pad, False)] if pad else []
    build_package(
        path,
        seed=seed,
        key=False,
        min_runtime_version=min_runtime_version,
        required_operators=OPS,
        extra_sections=extra,
    )
    with Package.open(path) as pkg:
        header = pkg.header
    header = replace(header, identity=replace(header.identity, name=name, version=version))
    signer = make_key(0) if key is True else (key or None)
    path.write_bytes(replace_header(path.read_bytes(), header, sign_with=signer))
    return path


def updater(store: Store, where: Path, *, bootstrap: bytes | bool | None = True) -> Updater:
    """A TUF client with its cache in ``where``; bootstrap=True: trust 1.root.json,
    None: start from the cache (a device that already ran)."""
    (where / "meta").mkdir(parents=True, exist_ok=True)
    if bootstrap is True:
        bootstrap = store.get_bytes("metadata/1.root.json")[0]
    return Updater(
        str(where / "meta"),
        METADATA_URL,
        str(where / "targets"),
        TARGETS_URL,
        fetcher=StoreFetcher(store),
        bootstrap=bootstrap,
    )


def download(u: Updater, path: str) -> bytes:
    info = u.get_targetinfo(path)
    assert info is not None, f"{path} is not a target"
    return Path(u.download_target(info)).read_bytes()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(tmp_path / "store")


@pytest.fixture
def keys(tmp_path: Path) -> KeyRing:
    return KeyRing(tmp_path / "keys")


@pytest.fixture
def repo(store: Store, keys: KeyRing) -> ReleaseRepository:
    """A fresh repository that precomputes no deltas (the delta tests use delta_repo)."""
    r = ReleaseRepository(store, keys)
    r.init(policy=RepoPolicy(delta_count=0))
    return r


@pytest.fixture
def delta_repo(store: Store, keys: KeyRing) -> ReleaseRepository:
    """A fresh repository with the default policy: deltas from the last 3 releases."""
    r = ReleaseRepository(store, keys)
    r.init()
    return r


@pytest.fixture
def pkgs(tmp_path: Path) -> dict[str, Path]:
    d = tmp_path / "pkgs"
    d.mkdir()
    return {v: make_pkg(d / f"m-{v}.epk", v, seed=i) for i, v in enumerate(["1.0.0", "1.1.0"])}


# ----------------------------------------------------------------------- init


def test_init_creates_version_one_and_keeps_keys_out_of_the_store(
    store: Store, keys: KeyRing, tmp_path: Path
) -> None:
    repo = ReleaseRepository(store, keys)
    state = repo.init(root_keys=3, root_threshold=2)
    assert sorted(o.key for o in store.list()) == [
        "metadata/1.root.json",
        "metadata/1.snapshot.json",
        "metadata/1.targets.json",
        "metadata/root.json",
        "metadata/timestamp.json",
    ]
    root = state.root
    assert root.consistent_snapshot is True
    assert root.roles["root"].threshold == 2 and len(root.roles["root"].keyids) == 3
    for role in ("targets", "snapshot", "timestamp"):
        assert len(root.roles[role].keyids) == 1
    key_files = sorted(p.name.split("-")[0] for p in (tmp_path / "keys").glob("*.key"))
    assert key_files == ["root", "root", "root", "snapshot", "targets", "timestamp"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "keys").glob("*.key"))
    assert state.policy == RepoPolicy()
    with pytest.raises(RepositoryExistsError):
        repo.init()
    # a stock TUF client accepts it
    u = updater(store, tmp_path / "client")
    u.refresh()
    assert u.get_targetinfo("nothing/here.epk") is None


def test_uninitialised_store(tmp_path: Path) -> None:
    with pytest.raises(RepositoryNotInitializedError) as info:
        ReleaseRepository(open_store(tmp_path / "empty")).load()
    assert exit_code_for(info.value) == EXIT_USAGE


# ----------------------------------------------------------------------- publishing


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_publish_then_a_tuf_client_downloads_and_verifies(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, pkgs: dict[str, Path]
) -> None:
    if backend == "s3":
        server: MotoServer = request.getfixturevalue("s3_server")
        server.create_bucket("edgepack-releases")
        store = open_store(f"s3://edgepack-releases/{uuid.uuid4().hex[:10]}")
    else:
        store = open_store(tmp_path / "store")
    repo = ReleaseRepository(store, KeyRing(tmp_path / "keys"))
    repo.init()
    result = repo.publish(pkgs["1.0.0"], "beta", rollout=12.5)
    assert result.uploaded and result.versions == {
        "root": 1,
        "targets": 2,
        "snapshot": 2,
        "timestamp": 2,
    }
    u = updater(store, tmp_path / "client")
    path = "tiny-llama/beta/tiny-llama-1.0.0.epk"
    info = u.get_targetinfo(path)
    custom = info.custom["edgepack"]
    assert custom["model"] == "tiny-llama" and custom["version"] == "1.0.0"
    assert custom["channel"] == "beta" and custom["rollout_bp"] == 1250
    raw = pkgs["1.0.0"].read_bytes()
    assert info.length == len(raw) and info.hashes == {"sha256": hashlib.sha256(raw).hexdigest()}
    req = custom["requirements"]
    assert req["min_runtime_version"] == "0.2.0"
    assert req["required_operators"] == [["llama.decoder", 2], ["matmul.int4_group_sym", 1]]
    assert (req["format_version"], req["quantization_schema_version"]) == (1, 1)
    assert req["operator_set_version"] == 1
    assert download(u, path) == raw
    # what landed is a package that opens
    with Package.open(u.find_cached_target(info)) as pkg:
        assert pkg.header.identity.version == "1.0.0"


def test_release_fields_and_compatibility_selection(
    repo: ReleaseRepository, pkgs: dict[str, Path], tmp_path: Path
) -> None:
    newer = make_pkg(tmp_path / "m2.epk", "2.0.0", seed=9, min_runtime_version="0.5.0")
    repo.publish(pkgs["1.0.0"], "stable")
    repo.publish(newer, "stable")
    index = repo.index()
    latest = index.latest("tiny-llama", "stable")
    assert latest.version == "2.0.0" and latest.requirements.min_runtime_version == "0.5.0"
    old_runtime = RuntimeCapabilities("0.3.0", operators={n: v for n, v in OPS})
    new_runtime = RuntimeCapabilities("0.5.1", operators={n: v for n, v in OPS})
    assert index.select("tiny-llama", "stable", "dev-1", old_runtime).version == "1.0.0"
    assert index.select("tiny-llama", "stable", "dev-1", new_runtime).version == "2.0.0"
    no_ops = RuntimeCapabilities("9.0.0")
    assert index.select("tiny-llama", "stable", "dev-1", no_ops) is None
    verdict = latest.requirements.check(old_runtime)
    assert not verdict and "0.5.0" in verdict.summary()
    # round trip through the custom fields
    again = ReleaseInfo.from_target(
        latest.path, latest.length, {"sha256": latest.sha256}, latest.custom()
    )
    assert again == latest
    assert Requirements.from_dict(latest.requirements.to_dict()) == latest.requirements


def test_versions_on_a_channel_only_go_up(
    repo: ReleaseRepository, store: Store, pkgs: dict[str, Path], tmp_path: Path
) -> None:
    repo.publish(pkgs["1.1.0"], "beta")
    before = repo.load().versions()
    with pytest.raises(VersionNotIncreasingError) as info:
        repo.publish(pkgs["1.1.0"], "beta")
    assert exit_code_for(info.value) == EXIT_USAGE and info.value.latest == "1.1.0"
    with pytest.raises(VersionNotIncreasingError):
        repo.publish(pkgs["1.0.0"], "beta")
    # refused before uploading anything
    sha_old = hashlib.sha256(pkgs["1.0.0"].read_bytes()).hexdigest()
    assert not store.exists(f"objects/sha256/{sha_old}")
    assert repo.load().versions() == before
    # other channels have their own order
    repo.publish(pkgs["1.0.0"], "stable")
    # rollback = the old content again, under a higher version
    rollback = make_pkg(tmp_path / "rb.epk", "1.1.1", seed=0)  # seed 0 = 1.0.0's weights
    repo.publish(rollback, "beta")
    assert repo.index().latest("tiny-llama", "beta").version == "1.1.1"
    # one version, one content
    other = make_pkg(tmp_path / "x.epk", "1.1.0", seed=42)
    with pytest.raises(VersionConflictError):
        repo.publish(other, "nightly")
    # pre-releases sort before their release
    for v, seed in (("2.0.0-rc.1", 5), ("2.0.0-rc.2", 6), ("2.0.0", 7)):
        repo.publish(make_pkg(tmp_path / f"{v}.epk", v, seed=seed), "beta")
    with pytest.raises(VersionNotIncreasingError):
        repo.publish(make_pkg(tmp_path / "rc3.epk", "2.0.0-rc.3", seed=8), "beta")
    assert semver_precedence("2.0.0-rc.10") > semver_precedence("2.0.0-rc.9")
    assert semver_precedence("1.0.0+build.5") == semver_precedence("1.0.0")


def test_promote_and_rollout_changes(
    repo: ReleaseRepository, store: Store, pkgs: dict[str, Path], tmp_path: Path
) -> None:
    repo.publish(pkgs["1.0.0"], "beta", rollout=5)
    repo.publish(pkgs["1.1.0"], "beta", rollout=5)
    objects = len(list(store.list("objects/")))
    result = repo.promote("1.0.0", "stable")
    assert result.release.channel == "stable" and result.release.rollout_percent == 100
    assert len(list(store.list("objects/"))) == objects  # no re-upload
    result = repo.promote("1.1.0", "beta", rollout=50)
    assert result.release.rollout_bp == 5000
    assert repo.promote("1.1.0", "beta", rollout=50).changed is False
    with pytest.raises(UnknownReleaseError):
        repo.promote("9.9.9", "stable")
    repo.promote("1.1.0", "stable", rollout=1)
    repo.promote("1.1.0", "canary")
    with pytest.raises(VersionNotIncreasingError):
        repo.promote("1.0.0", "canary")
    other = make_pkg(tmp_path / "o.epk", "1.0.0", name="other-model", seed=3)
    repo.publish(other, "beta")
    with pytest.raises(ReleasePolicyError, match="--model"):
        repo.promote("1.0.0", "stable-3")
    repo.promote("1.0.0", "stable-3", model="other-model")
    u = updater(store, tmp_path / "client")
    assert download(u, "tiny-llama/stable/tiny-llama-1.0.0.epk") == pkgs["1.0.0"].read_bytes()
    assert (
        u.get_targetinfo("tiny-llama/stable/tiny-llama-1.1.0.epk").custom["edgepack"]["rollout_bp"]
        == 100
    )


def test_staged_rollout_by_hashed_device_id() -> None:
    ids = [f"device-{i}" for i in range(20_000)]
    for bp in (0, 100, 1000, 5000, 10_000):
        share = sum(in_rollout(d, "m", "beta", "1.0.0", bp) for d in ids) / len(ids)
        assert abs(share - bp / 10_000) < 0.01
    # raising the percentage only adds devices; other releases sample other devices
    at10 = {d for d in ids if in_rollout(d, "m", "beta", "1.0.0", 1000)}
    at50 = {d for d in ids if in_rollout(d, "m", "beta", "1.0.0", 5000)}
    assert at10 <= at50
    other = {d for d in ids if in_rollout(d, "m", "beta", "1.1.0", 1000)}
    assert 0.05 < len(at10 & other) / len(at10) < 0.2
    # select() falls back to the newest release the device is in
    req = Requirements(1, "0.1.0", 1, 1)
    rel = [
        ReleaseInfo(f"m/beta/m-{v}.epk", "m", v, "beta", bp, "0" * 64, 1, req)
        for v, bp in (("1.0.0", 10_000), ("1.1.0", 1000))
    ]
    index = ReleaseIndex(rel)
    inside = next(d for d in ids if rel[1].in_rollout(d))
    outside = next(d for d in ids if not rel[1].in_rollout(d))
    assert index.select("m", "beta", inside).version == "1.1.0"
    assert index.select("m", "beta", outside).version == "1.0.0"


# ----------------------------------------------------------------------- TUF defences


def test_expired_metadata_is_refused_until_refreshed(
    store: Store, keys: KeyRing, pkgs: dict[str, Path], tmp_path: Path
) -> None:
    past = dt.datetime.now(dt.timezone.utc).replace(microsecond=0) - dt.timedelta(days=10)
    stale = ReleaseRepository(store, keys, clock=lambda: past)
    stale.init()
    stale.publish(pkgs["1.0.0"], "beta")  # timestamp signed 10 days ago, lives 7
    with pytest.raises(tuf_exc.ExpiredMetadataError) as info:
        updater(store, tmp_path / "c1").refresh()
    mapped = map_tuf_error(info.value)
    assert isinstance(mapped, ExpiredMetadataError) and exit_code_for(mapped) == EXIT_SIGNATURE
    repo = ReleaseRepository(store, keys)
    assert [role for role, _ in repo.expired(repo.load())] == ["timestamp"]
    repo.refresh()
    assert repo.expired(repo.load()) == []
    u = updater(store, tmp_path / "c2")
    assert download(u, "tiny-llama/beta/tiny-llama-1.0.0.epk") == pkgs["1.0.0"].read_bytes()


def test_metadata_rollback_is_refused(
    repo: ReleaseRepository, store: Store, pkgs: dict[str, Path], tmp_path: Path
) -> None:
    repo.publish(pkgs["1.0.0"], "beta")
    old_timestamp = store.get_bytes("metadata/timestamp.json")[0]
    repo.publish(pkgs["1.1.0"], "beta")
    updater(store, tmp_path / "device").refresh()  # the device saw the newer state
    store.put_bytes("metadata/timestamp.json", old_timestamp)  # an attacker or a backup restore
    with pytest.raises(tuf_exc.BadVersionNumberError) as info:
        updater(store, tmp_path / "device", bootstrap=None).refresh()
    assert isinstance(map_tuf_error(info.value), RollbackError)
    # the publisher notices too (versions recorded in the keys directory)
    with pytest.raises(RollbackError) as pub:
        repo.load()
    assert pub.value.role == "timestamp" and pub.value.trusted_version == 3


def test_tampered_metadata_is_refused(
    repo: ReleaseRepository, store: Store, pkgs: dict[str, Path], tmp_path: Path
) -> None:
    repo.publish(pkgs["1.0.0"], "beta")
    targets_key = "metadata/2.targets.json"
    good = store.get_bytes(targets_key)[0]
    tampered = good.replace(b'"rollout_bp": 10000', b'"rollout_bp": 9999')
    assert tampered != good
    store.local_path(targets_key).chmod(0o644)
    store.local_path(targets_key).write_bytes(tampered)
    with pytest.raises(RepositoryError, match="does not match"):
        repo.load()
    with pytest.raises(tuf_exc.RepositoryError):
        updater(store, tmp_path / "c").refresh()
    store.local_path(targets_key).write_bytes(good)
    # a root swapped for one with other keys: the pinned root catches it
    evil_keys = KeyRing(tmp_path / "evil")
    evil = ReleaseRepository(open_store(tmp_path / "evil-store"), evil_keys)
    evil.init()
    store.put_bytes("metadata/1.root.json", evil.store.get_bytes("metadata/1.root.json")[0])
    with pytest.raises(MetadataSignatureError) as info:
        repo.load()
    assert exit_code_for(info.value) == EXIT_SIGNATURE


@pytest.mark.parametrize("role", ["targets", "snapshot", "timestamp", "root"])
def test_key_rotation_keeps_clients_updating(
    role: str,
    repo: ReleaseRepository,
    store: Store,
    keys: KeyRing,
    pkgs: dict[str, Path],
    tmp_path: Path,
) -> None:
    repo.publish(pkgs["1.0.0"], "beta")
    updater(store, tmp_path / "device").refresh()  # a device on root v1
    old_ids = list(repo.load().root.roles[role].keyids)
    new_root = repo.rotate_key(role)
    assert new_root.version == 2 and set(new_root.roles[role].keyids).isdisjoint(old_ids)
    root_md = Metadata.from_bytes(store.get_bytes("metadata/2.root.json")[0])
    if role == "root":  # signed by the old and the new root keys
        assert set(old_ids) | set(new_root.roles["root"].keyids) <= set(root_md.signatures)
    assert store.get_bytes("metadata/root.json")[0] == store.get_bytes("metadata/2.root.json")[0]
    retired = {p.stem.split("-")[1] for p in (tmp_path / "keys" / "retired").glob("*.key")}
    assert retired == {k[:16] for k in old_ids}
    repo.publish(pkgs["1.1.0"], "beta")
    path = "tiny-llama/beta/tiny-llama-1.1.0.epk"
    device = updater(store, tmp_path / "device", bootstrap=None)
    assert download(device, path) == pkgs["1.1.0"].read_bytes()
    fresh = updater(store, tmp_path / "fresh")
    assert download(fresh, path) == pkgs["1.1.0"].read_bytes()
    if role == "timestamp":  # the retired key can no longer sign for the role
        old = KeyRing(tmp_path / "keys" / "retired").signers()[old_ids[0]]
        ts = Metadata.from_bytes(store.get_bytes("metadata/timestamp.json")[0]).signed
        forged = Timestamp(ts.version + 1, ts.spec_version, ts.expires, ts.snapshot_meta)
        store.put_bytes("metadata/timestamp.json", serialize(sign(forged, [old])))
        with pytest.raises(tuf_exc.UnsignedMetadataError):
            updater(store, tmp_path / "device", bootstrap=None).refresh()


def test_root_threshold_and_missing_keys(
    store: Store, keys: KeyRing, pkgs: dict[str, Path], tmp_path: Path
) -> None:
    repo = ReleaseRepository(store, keys)
    repo.init(root_keys=3, root_threshold=2)
    root_files = sorted((tmp_path / "keys").glob("root-*.key"))
    (tmp_path / "offline").mkdir()
    shutil.move(root_files[0], tmp_path / "offline")  # 2 of 3 root keys: still enough
    repo = ReleaseRepository(store, KeyRing(tmp_path / "keys"))
    repo.rotate_key("timestamp")
    shutil.move(root_files[1], tmp_path / "offline")
    repo = ReleaseRepository(store, KeyRing(tmp_path / "keys"))
    with pytest.raises(MissingKeyError, match="1 of the 2 root"):
        repo.rotate_key("snapshot")
    repo.publish(pkgs["1.0.0"], "beta")  # the online roles need no root key
    assert download(updater(store, tmp_path / "c"), "tiny-llama/beta/tiny-llama-1.0.0.epk")
    publisher = ReleaseRepository(store, KeyRing(tmp_path / "offline"))  # root keys only
    with pytest.raises(MissingKeyError, match="targets"):
        publisher.publish(pkgs["1.1.0"], "beta")


def test_package_signature_policy(store: Store, keys: KeyRing, tmp_path: Path) -> None:
    release_key = make_key(7)
    pub = tmp_path / "release.pub"
    from cryptography.hazmat.primitives import serialization

    pub.write_bytes(
        release_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    from edgepack.format import key_id, load_public_key

    kid = key_id(load_public_key(pub)).hex()
    repo = ReleaseRepository(store, keys)
    repo.init(policy=RepoPolicy(package_keys={kid: pub.read_text()}))
    with pytest.raises(SignatureError, match="not signed"):
        repo.publish(make_pkg(tmp_path / "u.epk", "1.0.0", key=None), "beta")
    with pytest.raises(SignatureError, match="not by a trusted key"):
        repo.publish(make_pkg(tmp_path / "w.epk", "1.0.0", key=make_key(1)), "beta")
    good = make_pkg(tmp_path / "g.epk", "1.0.0", key=release_key)
    assert repo.publish(good, "beta").release.signers == (kid,)
    corrupt = tmp_path / "c.epk"
    raw = bytearray(make_pkg(corrupt, "1.1.0", key=release_key).read_bytes())
    with Package.open(corrupt) as pkg:
        offset = pkg.header.tensors[0].codes.offset
    raw[offset] ^= 0xFF  # a tensor byte: its hash no longer matches
    corrupt.write_bytes(bytes(raw))
    with pytest.raises(CorruptPackageError, match="hash mismatch") as info:
        repo.publish(corrupt, "beta")
    assert exit_code_for(info.value) == EXIT_CORRUPT
    assert len(repo.index()) == 1


# ----------------------------------------------------------------------- commit protocol


def test_leftovers_of_an_interrupted_publish_are_skipped(
    repo: ReleaseRepository, store: Store, pkgs: dict[str, Path], tmp_path: Path
) -> None:
    store.put_bytes("metadata/2.targets.json", b"{half a publish}")
    store.put_bytes("metadata/2.snapshot.json", b"{half a publish}")
    result = repo.publish(pkgs["1.0.0"], "beta")
    assert result.versions["targets"] == 3 and result.versions["snapshot"] == 3
    assert repo.verify(deep=True) == []
    assert download(updater(store, tmp_path / "c"), "tiny-llama/beta/tiny-llama-1.0.0.epk")


def test_concurrent_publishers_both_land(
    store: Store, keys: KeyRing, pkgs: dict[str, Path], tmp_path: Path
) -> None:
    ReleaseRepository(store, keys).init()
    other = ReleaseRepository(store, keys)
    other_pkg = make_pkg(tmp_path / "o.epk", "3.0.0", name="other", seed=4)
    raced = []

    class Racing(ReleaseRepository):
        def _ensure_deltas(self, *args: Any, **kw: Any) -> Any:
            if not raced:  # another publisher commits while this one is mid-publish
                raced.append(other.publish(other_pkg, "beta"))
            return super()._ensure_deltas(*args, **kw)

    result = Racing(store, keys).publish(pkgs["1.0.0"], "beta")
    assert raced and result.versions["timestamp"] == 3
    assert {r.model for r in ReleaseRepository(store).index()} == {"tiny-llama", "other"}
    # with no retries left the conflict surfaces, retriable and typed
    state = other.load()
    other.publish(make_pkg(tmp_path / "o2.epk", "3.1.0", name="other", seed=5), "beta")
    with pytest.raises(ConcurrentUpdateError) as info:
        other._commit(state, targets=state.editable_targets())
    assert info.value.retriable


# ----------------------------------------------------------------------- deltas


class FakeCodec:
    """Stands in for edgepack.server.delta: a deterministic 'delta' per pair."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def create_delta(self, old: str, new: str, out: str, signing_keys: tuple = ()) -> None:
        a, b = (hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in (old, new))
        self.calls.append((a, b))
        Path(out).write_bytes(b"EPKD" + bytes.fromhex(a) + bytes.fromhex(b))


@pytest.fixture
def codec(monkeypatch: pytest.MonkeyPatch) -> FakeCodec:
    fake = FakeCodec()
    module = types.ModuleType("edgepack.server.delta")
    module.create_delta = fake.create_delta  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "edgepack.server.delta", module)
    return fake


def test_publish_precomputes_deltas_from_the_last_releases(
    delta_repo: ReleaseRepository, store: Store, codec: FakeCodec, tmp_path: Path
) -> None:
    versions = ["1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0"]
    paths = {v: make_pkg(tmp_path / f"{v}.epk", v, seed=i) for i, v in enumerate(versions)}
    sha = {v: hashlib.sha256(p.read_bytes()).hexdigest() for v, p in paths.items()}
    for v in versions:
        delta_repo.publish(paths[v], "beta")
    latest = delta_repo.index().latest("tiny-llama", "beta")
    assert [d.from_version for d in latest.deltas] == ["1.3.0", "1.2.0", "1.1.0"]  # N = 3
    for d in latest.deltas:
        assert store.stat(d.object_key).size == d.length
    u = updater(store, tmp_path / "c")
    first = latest.deltas[0]
    assert download(u, first.path) == b"EPKD" + bytes.fromhex(sha["1.3.0"]) + bytes.fromhex(
        sha["1.4.0"]
    )
    assert u.get_targetinfo(first.path).custom["edgepack"]["kind"] == "delta"
    # promotion: deltas from the target channel's releases; existing pairs reused
    delta_repo.publish(paths["1.0.0"], "stable")
    calls = len(codec.calls)
    promoted = delta_repo.promote("1.4.0", "stable").release
    assert [d.from_version for d in promoted.deltas] == ["1.0.0"]
    assert len(codec.calls) == calls + 1
    delta_repo.publish(paths["1.3.0"], "stable-b")
    again = delta_repo.promote("1.4.0", "stable-b").release
    assert [d.path for d in again.deltas] == [first.path]  # the 1.3.0 -> 1.4.0 delta, reused
    assert len(codec.calls) == calls + 1
    # configurable per publish
    more = make_pkg(tmp_path / "1.5.0.epk", "1.5.0", seed=11)
    assert len(delta_repo.publish(more, "beta", delta_count=1).release.deltas) == 1
    assert delta_repo.verify() == []


def test_delta_codec_failures_never_fail_a_publish(
    delta_repo: ReleaseRepository,
    pkgs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    module = types.ModuleType("edgepack.server.delta")

    def broken(*args: Any, **kw: Any) -> None:
        raise RuntimeError("codec bug")

    module.create_delta = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "edgepack.server.delta", module)
    delta_repo.publish(pkgs["1.0.0"], "beta")
    with caplog.at_level(logging.WARNING, logger="edgepack"):
        result = delta_repo.publish(pkgs["1.1.0"], "beta")
    assert result.release.deltas == ()
    assert "codec bug" in caplog.text


def test_missing_delta_codec_is_skipped_with_one_log_line(
    delta_repo: ReleaseRepository,
    pkgs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "edgepack.server.delta", None)  # import fails
    monkeypatch.setattr(deltas_mod, "_warned", False)
    delta_repo.publish(pkgs["1.0.0"], "beta")
    with caplog.at_level(logging.WARNING, logger="edgepack"):
        result = delta_repo.publish(pkgs["1.1.0"], "beta")
    assert result.release.deltas == ()
    assert caplog.text.count("precomputed deltas skipped") == 1


def test_real_delta_codec_if_present(
    delta_repo: ReleaseRepository, store: Store, tmp_path: Path
) -> None:
    """With the real codec: the precomputed delta, fetched through TUF, patches the old
    package into the new one byte for byte."""
    if not deltas_mod.delta_codec_available():
        pytest.skip("the delta codec (edgepack.server.delta) is not there yet")
    apply = pytest.importorskip("edgepack.format.delta").apply_delta
    old = make_pkg(tmp_path / "a.epk", "1.0.0", seed=1)
    new = make_pkg(tmp_path / "b.epk", "1.1.0", seed=1, pad=b"new section" * 500)
    delta_repo.publish(old, "beta")
    rel = delta_repo.publish(new, "beta").release
    assert len(rel.deltas) == 1 and rel.deltas[0].from_version == "1.0.0"
    u = updater(store, tmp_path / "device")
    delta = tmp_path / "d.epkd"
    delta.write_bytes(download(u, rel.deltas[0].path))
    apply(old, delta, tmp_path / "patched.epk")
    assert (tmp_path / "patched.epk").read_bytes() == new.read_bytes()


def test_fetcher_url_mapping() -> None:
    sha = "ab" * 32
    assert target_object_key(f"targets/m/beta/{sha}.m-1.0.0.epk") == f"objects/sha256/{sha}"
    assert target_object_key(f"m/deltas/{sha}.x.epkd") == f"objects/sha256/{sha}"
    assert target_object_key("targets/m/beta/m-1.0.0.epk") is None


# ----------------------------------------------------------------------- the CLI


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli_main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store, keys = str(tmp_path / "store"), str(tmp_path / "keys")
    common = ["--store", store, "--keys-dir", keys]
    p1 = make_pkg(tmp_path / "a.epk", "1.0.0", seed=1)
    p2 = make_pkg(tmp_path / "b.epk", "1.1.0", seed=2)
    code, out, err = run_cli(capsys, "repo", "init", *common, "--expires", "timestamp=1")
    assert code == 0, err
    assert "initialised" in out
    code, out, err = run_cli(
        capsys, "publish", str(p1), *common, "--channel", "beta", "--rollout", "10"
    )
    assert code == 0, err
    assert "published tiny-llama 1.0.0 on beta (10% rollout)" in out
    code, out, err = run_cli(capsys, "publish", str(p1), *common, "--channel", "beta")
    assert code == EXIT_USAGE
    assert err.startswith("error: ") and err.count("\n") == 1 and "only go up" in err
    code, out, err = run_cli(capsys, "publish", str(p2), *common, "--channel", "beta", "-v")
    assert code == 0, err
    assert "committed timestamp.json v3" in err  # --verbose logs the steps
    code, out, err = run_cli(
        capsys, "promote", "1.0.0", "--channel", "stable", "--rollout", "25", *common
    )
    assert code == 0, err
    code, out, err = run_cli(capsys, "releases", "--store", store, "--json")
    assert code == 0, err
    listing = json.loads(out)
    assert [(r["channel"], r["version"], r["rollout_percent"]) for r in listing["releases"]] == [
        ("beta", "1.0.0", 10.0),
        ("beta", "1.1.0", 100.0),
        ("stable", "1.0.0", 25.0),
    ]
    assert listing["metadata"]["timestamp"]["version"] == 4 and listing["expired"] == []
    code, out, err = run_cli(capsys, "releases", "--store", store)
    assert code == 0 and "stable   1.0.0    25%" in out
    code, out, err = run_cli(capsys, "repo", "rotate-key", "snapshot", *common)
    assert code == 0 and "root v2" in out, err
    code, out, err = run_cli(capsys, "repo", "refresh", *common)
    assert code == 0, err
    code, out, err = run_cli(capsys, "repo", "verify", "--store", store, "--deep")
    assert code == 0 and out.startswith("OK"), err
    u = updater(open_store(store), tmp_path / "client")
    assert download(u, "tiny-llama/stable/tiny-llama-1.0.0.epk") == p1.read_bytes()


def test_cli_exit_codes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store, keys = str(tmp_path / "store"), str(tmp_path / "keys")
    common = ["--store", store, "--keys-dir", keys]
    pub = tmp_path / "rel.pub"
    assert cli_main(["keygen", str(tmp_path / "rel")]) == 0
    capsys.readouterr()
    code, _, err = run_cli(capsys, "releases", "--store", store)
    assert code == EXIT_USAGE and "does not exist" in err
    assert run_cli(capsys, "repo", "init", *common, "--package-key", str(pub))[0] == 0
    unsigned = make_pkg(tmp_path / "u.epk", "1.0.0", key=None)
    code, _, err = run_cli(capsys, "publish", str(unsigned), *common, "--channel", "beta")
    assert code == EXIT_SIGNATURE and err.count("\n") == 1
    corrupt = tmp_path / "c.epk"
    raw = bytearray(unsigned.read_bytes())
    raw[200] ^= 0xFF  # inside the header: digest mismatch
    corrupt.write_bytes(bytes(raw))
    code, _, err = run_cli(capsys, "publish", str(corrupt), *common, "--channel", "beta")
    assert code == EXIT_CORRUPT and "error:" in err
    code, _, err = run_cli(
        capsys,
        "publish",
        str(unsigned),
        "--store",
        store,
        "--keys-dir",
        f"{store}/keys",
        "--channel",
        "beta",
    )
    assert code == EXIT_USAGE and "inside the store" in err
    code, _, err = run_cli(
        capsys, "publish", str(unsigned), *common, "--channel", "beta", "--rollout", "150"
    )
    assert code == EXIT_USAGE
    code, _, err = run_cli(capsys, "promote", "1.0.0", "--channel", "beta", *common)
    assert code == EXIT_USAGE and "no releases" in err
    code, _, err = run_cli(capsys, "publish", str(unsigned), *common, "--channel", "../x")
    assert code == EXIT_USAGE and "channel name" in err
