"""``convert``/``build`` ``--license --description --intended-use --card`` and the card
in ``inspect`` (text and ``--json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tinymodel import write_tiny_llama

from edgepack.cli import main
from edgepack.cli.exit_codes import EXIT_USAGE


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cardcli")
    write_tiny_llama(d / "model")
    (d / "model" / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    return d / "model"


def test_convert_flags_and_inspect(model: Path, tmp_path: Path, capsys) -> None:
    card = tmp_path / "card.md"
    card.write_text("---\ntraining_data: none, random weights\n---\n")
    out = tmp_path / "c.epk"
    code = main([
        "convert", str(model), "-o", str(out), "--encoding", "int8",
        "--description", "A tiny random Llama.", "--intended-use", "CLI tests",
        "--card", str(card),
    ])
    assert code == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["model_card"]
    assert doc["license"] == "mit" and doc["origin"]["license"] == "README.md front matter license"
    assert doc["description"] == "A tiny random Llama."
    assert doc["intended_use"] == "CLI tests" and doc["origin"]["intended_use"] == "--intended-use"
    assert doc["training_data"] == "none, random weights"
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model card" in text and "license        mit" in text
    assert "intended use   CLI tests" in text


def test_build_license_flag_and_bad_card(model: Path, tmp_path: Path, capsys) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('[quantize]\nencodings = ["int8"]\nalgorithm = "rtn"\nscale_search = false\n')
    out = tmp_path / "b.epk"
    args = ["build", str(model), "-o", str(out), "--recipe", str(recipe), "--no-report"]
    assert main([*args, "--license", "apache-2.0"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_card"]["license"] == "apache-2.0"
    bad = tmp_path / "bad.json"
    bad.write_text('{"licence": "mit"}')
    assert main([*args, "--force", "--card", str(bad)]) == EXIT_USAGE
    assert "unknown card field" in capsys.readouterr().err


def test_inspect_without_card(model: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "m").mkdir()
    write_tiny_llama(tmp_path / "m")
    out = tmp_path / "n.epk"
    assert main(["convert", str(tmp_path / "m"), "-o", str(out), "--encoding", "int8"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_card"] is None
    assert main(["inspect", str(out)]) == 0
    assert "model card   none" in capsys.readouterr().out
