"""Issue 11 items 3, 4 and 11: the publisher's trusted state is keyed by the repository,
not the spelling of its path; names are matched whole; `repo verify` sees a garbage
root.json and rollbacks; a root is renewed by `repo renew-root`."""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from pathlib import Path

import pytest
from s3server import MotoServer, s3_server  # noqa: F401
from securesystemslib.signer import CryptoSigner
from test_releases import make_pkg
from tuf.api.metadata import Metadata

from edgepack.cli import main as cli_main
from edgepack.cli.exit_codes import EXIT_CORRUPT, EXIT_OK, EXIT_SIGNATURE
from edgepack.format import parse_semver
from edgepack.server.errors import ReleasePolicyError, RollbackError
from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.metadata import RepoPolicy, serialize
from edgepack.server.releases.model import check_name
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import check_key, object_key, open_store


def _rolled_back(store_url: str, keys: KeyRing, pkgs_dir: Path) -> None:
    """Publish 1.0.0 and 1.1.0 at ``store_url``, then restore 1.0.0's timestamp.json."""
    repo = ReleaseRepository(open_store(store_url), keys)
    repo.init(policy=RepoPolicy(delta_count=0))
    repo.publish(make_pkg(pkgs_dir / "a.epk", "1.0.0", seed=0), "beta")
    old = repo.store.get_bytes("metadata/timestamp.json")[0]
    repo.publish(make_pkg(pkgs_dir / "b.epk", "1.1.0", seed=1), "beta")
    repo.store.put_bytes("metadata/timestamp.json", old)


# ----------------------------------------------------------------------- item 3


def test_rollback_is_refused_through_every_spelling_of_a_local_store(tmp_path: Path) -> None:
    real = tmp_path / "store"
    keys = KeyRing(tmp_path / "keys")
    (tmp_path / "pkgs").mkdir()
    _rolled_back(str(real), keys, tmp_path / "pkgs")
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "sub").mkdir()
    spellings = [
        str(real),
        str(tmp_path / "link"),
        str(tmp_path / "sub" / ".." / "store"),
        str(real) + "/",
        real.as_uri(),
    ]
    for spelling in spellings:
        repo = ReleaseRepository(open_store(spelling), keys)
        with pytest.raises(RollbackError) as info:
            repo.promote("1.0.0", "stable")
        assert info.value.role == "timestamp", spelling
    # nothing was committed on top of the rolled-back state
    assert not (real / "metadata" / "4.targets.json").exists()


def test_rollback_is_refused_through_every_form_of_an_s3_url(
    tmp_path: Path, s3_server: MotoServer  # noqa: F811
) -> None:
    s3_server.create_bucket("edgepack-sec")
    prefix = uuid.uuid4().hex[:10]
    keys = KeyRing(tmp_path / "keys")
    (tmp_path / "pkgs").mkdir()
    _rolled_back(f"s3://edgepack-sec/{prefix}", keys, tmp_path / "pkgs")
    for url in (
        f"s3://edgepack-sec/{prefix}/",
        f"s3://edgepack-sec//{prefix}",
        f"s3://edgepack-sec/{prefix}%2F",
    ):
        with pytest.raises(RollbackError):
            ReleaseRepository(open_store(url), keys).promote("1.0.0", "stable")


def test_the_state_is_keyed_by_the_first_root_and_old_state_is_adopted(tmp_path: Path) -> None:
    from edgepack.server.releases.metadata import repository_id

    store = open_store(tmp_path / "store")
    keys = KeyRing(tmp_path / "keys")
    repo = ReleaseRepository(store, keys)
    repo.init(policy=RepoPolicy(delta_count=0))
    rid = repository_id(store.get_bytes("metadata/1.root.json")[0])
    assert repo.repository_id() == rid
    state_file = tmp_path / "keys" / "state" / f"repo-{rid[:32]}.json"
    assert state_file.is_file()
    # a keys directory written by an older edgepack: state by the literal URL only
    legacy = keys._legacy_state_path(store.url)
    old = state_file.read_text().replace(f'"repository_id": "{rid}"', f'"url": "{store.url}"')
    legacy.write_text(old)
    state_file.unlink()
    assert ReleaseRepository(store, keys).has_trusted_state()


def test_a_replaced_first_root_sharing_the_repositorys_keys_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "store"
    keys = KeyRing(tmp_path / "keys")
    (tmp_path / "pkgs").mkdir()
    _rolled_back(str(real), keys, tmp_path / "pkgs")
    # the attacker's own root key, vouching for the publisher's real online keys
    md = Metadata.from_bytes((real / "metadata" / "1.root.json").read_bytes())
    root = md.signed
    attacker = CryptoSigner.generate_ed25519()
    for keyid in list(root.roles["root"].keyids):
        root.revoke_key(keyid, "root")
    root.add_key(attacker.public_key, "root")
    fake = Metadata(root)
    fake.sign(attacker)
    for name in ("1.root.json", "root.json"):
        path = real / "metadata" / name
        path.chmod(0o644)
        path.write_bytes(serialize(fake))
    with pytest.raises(RollbackError, match="replaced"):
        ReleaseRepository(open_store(real), keys).load()


# ----------------------------------------------------------------------- item 4


@pytest.mark.parametrize("name", ["tiny-llama\n", "beta\n"])
def test_names_ending_in_a_newline_are_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        check_name("model", name)
    store = open_store(tmp_path / "store")
    repo = ReleaseRepository(store, KeyRing(tmp_path / "keys"))
    repo.init(policy=RepoPolicy(delta_count=0))
    pkg = make_pkg(tmp_path / "p.epk", "1.0.0")
    with pytest.raises(ReleasePolicyError):
        repo.publish(pkg, name) if name == "beta\n" else repo.publish(pkg, "beta", model=name)
    assert repo.index().releases(None, None) == []


def test_versions_and_store_keys_ending_in_a_newline_are_refused() -> None:
    with pytest.raises(ValueError):
        parse_semver("1.0.0\n")
    with pytest.raises(ValueError):
        check_key("metadata/timestamp.json\n")
    with pytest.raises(ValueError):
        object_key("0" * 64 + "\n")


# ----------------------------------------------------------------------- item 11


def _cli(*args: str) -> int:
    return cli_main(list(args))


def test_repo_verify_sees_a_garbage_root_json(tmp_path: Path, capsys) -> None:
    store = tmp_path / "store"
    assert _cli("repo", "init", "--store", str(store), "--keys-dir", str(tmp_path / "k")) == 0
    assert _cli("repo", "verify", "--store", str(store)) == EXIT_OK
    root_json = store / "metadata" / "root.json"
    root_json.chmod(0o644)
    root_json.write_bytes(b"garbage")
    capsys.readouterr()
    assert _cli("repo", "verify", "--store", str(store)) == EXIT_CORRUPT
    assert "metadata/root.json" in capsys.readouterr().err


def test_repo_verify_sees_a_rollback_through_the_keys_directory(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    (tmp_path / "pkgs").mkdir()
    _rolled_back(str(store), KeyRing(tmp_path / "keys"), tmp_path / "pkgs")
    monkeypatch.chdir(tmp_path)  # the default --keys-dir is ./edgepack-keys: absent here
    assert _cli("repo", "verify", "--store", str(store)) == EXIT_OK
    assert "rollback NOT checked" in capsys.readouterr().out
    keys = str(tmp_path / "keys")
    assert _cli("repo", "verify", "--store", str(store), "--keys-dir", keys) == EXIT_SIGNATURE


def test_an_expired_root_is_renewed_by_renew_root_not_refresh(tmp_path: Path, caplog) -> None:
    now = [dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)]
    store = open_store(tmp_path / "store")
    keys = KeyRing(tmp_path / "keys")
    ReleaseRepository(store, keys, clock=lambda: now[0]).init()
    now[0] += dt.timedelta(days=400)  # past the root's 365 days
    repo = ReleaseRepository(store, keys, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="edgepack"):
        repo.refresh(force=True)
    assert [role for role, _ in repo.expired(repo.load())] == ["root"]
    assert any("renew-root" in r.getMessage() for r in caplog.records)
    renewed = repo.renew_root()
    assert renewed.version == 2
    assert repo.expired(repo.load()) == []
    assert store.get_bytes("metadata/root.json")[0] == store.get_bytes("metadata/2.root.json")[0]
