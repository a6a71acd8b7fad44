"""``publish`` copies the package's model card into the release's signed target metadata
(``custom.edgepack.model_card``), so ``releases`` and any TUF client listing see it;
``promote`` keeps it."""

from __future__ import annotations

import json
from pathlib import Path

from pkgfactory import build_package

from edgepack.cli import main
from edgepack.format import SectionKind
from edgepack.format.model_card import MODEL_CARD_SECTION
from edgepack.server.releases.keys import KeyRing
from edgepack.server.releases.metadata import RepoPolicy
from edgepack.server.releases.repository import ReleaseRepository
from edgepack.server.store import open_store

CARD = {
    "license": "apache-2.0",
    "intended_use": "Tests.",
    "origin": {"license": "gguf general.license", "intended_use": "--intended-use"},
}


def _pkg(path: Path, card: dict | None, seed: int = 0) -> Path:
    extra = []
    if card is not None:
        data = json.dumps(card).encode()
        extra = [(int(SectionKind.METADATA_JSON), MODEL_CARD_SECTION, data, False)]
    build_package(path, seed=seed, key=False, extra_sections=extra)
    return path


def test_publish_carries_the_card(tmp_path: Path, capsys) -> None:
    store = open_store(tmp_path / "store")
    repo = ReleaseRepository(store, KeyRing(tmp_path / "keys"))
    repo.init(policy=RepoPolicy(delta_count=0))
    rel = repo.publish(_pkg(tmp_path / "a.epk", CARD), "beta").release
    assert rel.model_card == CARD
    targets = repo.load().targets_md.signed  # what the signed targets.json holds
    custom = targets.targets[rel.path].custom["edgepack"]
    assert custom["model_card"] == CARD
    promoted = repo.promote(rel.version, "stable").release
    assert promoted.model_card == CARD
    capsys.readouterr()
    assert main(["releases", "--store", str(tmp_path / "store"), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)["releases"]
    assert [r["model_card"]["license"] for r in listing] == ["apache-2.0", "apache-2.0"]
    assert main(["releases", "--store", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert "LICENSE" in out and "apache-2.0" in out


def test_publish_without_card(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    repo = ReleaseRepository(store, KeyRing(tmp_path / "keys"))
    repo.init(policy=RepoPolicy(delta_count=0))
    rel = repo.publish(_pkg(tmp_path / "b.epk", None, seed=1), "beta").release
    assert rel.model_card is None
    targets = repo.load().targets_md.signed  # what the signed targets.json holds
    assert "model_card" not in targets.targets[rel.path].custom["edgepack"]
