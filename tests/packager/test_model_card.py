"""The model card: from a GGUF's metadata, a Hugging Face README's front matter, a card
file and flags (in rising precedence), into the package's ``model_card`` section, through
``convert`` and ``build`` (and a float package used as a build source)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_fixtures import tied_tiny_gguf

from edgepack.format import Package, SectionKind
from edgepack.format.model_card import MODEL_CARD_SECTION, read_model_card
from edgepack.packager.build import build
from edgepack.packager.convert import convert
from edgepack.packager.importers.synthetic import TinyLlamaSpec, write_hf_llama
from edgepack.packager.model_card import (
    ModelCardError,
    card_overrides,
    read_card_markdown,
    source_card,
)
from edgepack.packager.recipe import parse_recipe

SPEC = TinyLlamaSpec(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, vocab_size=288,
    tie_word_embeddings=True,
)
GGUF_META = {
    "general.license": "apache-2.0",
    "general.description": "A tiny test model.",
    "general.source.url": "https://example.org/tiny",
    "general.organization": "Example Org",
}
README = """---
license: mit
datasets:
  - example/corpus-a
  - example/corpus-b
base_model: example/tiny-base
tags: [test]
---
# Tiny

![logo](logo.png)

## Model summary

Tiny is a random model used by the
edgepack tests.

## Intended uses

Testing the packager only; not for any real task.
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("card")


@pytest.fixture(scope="module")
def gguf(root: Path) -> Path:
    return tied_tiny_gguf(root / "tiny.gguf", SPEC, metadata=GGUF_META)


@pytest.fixture(scope="module")
def hf_dir(root: Path) -> Path:
    d = root / "hf"
    write_hf_llama(d, SPEC)
    (d / "README.md").write_text(README)
    return d


def _card(path: Path) -> dict:
    with Package.open(path) as pkg:
        card = read_model_card(pkg)
        (sec,) = [s for s in pkg.sections(SectionKind.METADATA_JSON)]
        assert sec.name == MODEL_CARD_SECTION and sec.media_type == "application/json"
    return card


def test_gguf_metadata_to_the_package(root: Path, gguf: Path) -> None:
    card = _card(convert(gguf, root / "g.epk", encoding="int8").path)
    assert card["license"] == "apache-2.0"
    assert card["description"] == "A tiny test model."
    assert card["source"] == "https://example.org/tiny"  # an address beats the organization
    assert card["origin"]["license"] == "gguf general.license"
    assert "intended_use" not in card and "training_data" not in card


def test_hf_readme_front_matter_and_sections(root: Path, hf_dir: Path) -> None:
    card = _card(convert(hf_dir, root / "h.epk", encoding="int8").path)
    assert card["license"] == "mit"
    assert card["training_data"] == "example/corpus-a, example/corpus-b"
    assert card["source"] == "example/tiny-base"
    assert card["description"] == "Tiny is a random model used by the edgepack tests."
    assert card["intended_use"] == "Testing the packager only; not for any real task."
    assert card["origin"]["license"] == "README.md front matter license"
    assert card["origin"]["intended_use"] == "README.md section"


def test_flags_over_card_file_over_source(root: Path, gguf: Path) -> None:
    card_file = root / "card.json"
    card_file.write_text(json.dumps({"license": "cc-by-4.0", "training_data": "synthetic"}))
    given = card_overrides(card_file, description="From the flag.", intended_use="Demos.")
    card = _card(convert(gguf, root / "f.epk", encoding="int8", card=given).path)
    assert card["license"] == "cc-by-4.0" and card["origin"]["license"] == "card.json"
    assert card["description"] == "From the flag." and card["origin"]["description"] == (
        "--description"
    )
    assert card["intended_use"] == "Demos."
    assert card["training_data"] == "synthetic"
    assert card["source"] == "https://example.org/tiny"  # the source's, not overridden


def test_build_carries_the_card_and_its_flags(root: Path, gguf: Path) -> None:
    recipe = parse_recipe({"quantize": {"encodings": ["int8"], "algorithm": "rtn",
                                        "scale_search": False}})
    given = card_overrides(license="bsd-3-clause")
    out = build(gguf, root / "b.epk", recipe, report=False, card=given).path
    card = _card(out)
    assert card["license"] == "bsd-3-clause" and card["description"] == "A tiny test model."
    # a float package as the build source: its card is the source's card
    f32 = convert(gguf, root / "f32.epk", encoding="f32", card=card_overrides(
        intended_use="Float reference."))
    again = _card(build(f32.path, root / "b2.epk", recipe, report=False).path)
    assert again["intended_use"] == "Float reference."
    assert again["origin"]["intended_use"] == "--intended-use"
    assert again["license"] == "apache-2.0"


def test_no_metadata_no_section(root: Path) -> None:
    bare = tied_tiny_gguf(root / "bare.gguf", SPEC)
    out = convert(bare, root / "bare.epk", encoding="int8").path
    with Package.open(out) as pkg:
        assert read_model_card(pkg) is None
        assert not pkg.sections(SectionKind.METADATA_JSON)


def test_card_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    for text, match in (
        ("[1]", "JSON object"),
        ('{"licence": "mit"}', "unknown card field"),
        ('{"license": 3}', "must be a string"),
        ("not json", "not JSON"),
    ):
        bad.write_text(text)
        with pytest.raises(ModelCardError, match=match):
            card_overrides(bad)
    md = tmp_path / "card.md"
    md.write_text("---\nlicense: [unclosed\n---\nbody\n")
    with pytest.raises(ModelCardError, match="not valid YAML"):
        card_overrides(md)


def test_markdown_card_and_source_without_readme(tmp_path: Path) -> None:
    fields = read_card_markdown("---\nintended_use: Chat demos\n---\n# T\n\nBody text.\n", "c.md")
    assert fields["intended_use"] == ("Chat demos", "c.md front matter intended_use")
    assert "description" not in fields  # a paragraph under no named heading is not taken
    assert source_card([tmp_path / "model.safetensors"], {"hidden_size": 8}) == {}
