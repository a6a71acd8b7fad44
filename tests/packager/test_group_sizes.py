"""Group sizes are never substituted: a size the help does not list is refused, and a
tensor whose rows a listed size does not divide falls back visibly (issue 16, blocker 1)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgepack.format import Encoding, Package, SectionKind
from edgepack.format.constants import MAX_GROUP_SIZE, MIN_GROUP_SIZE
from edgepack.packager.convert import convert, plan_encodings
from edgepack.packager.encode import GROUP_SIZES, encoding_help, parse_encoding
from edgepack.packager.recipe import RecipeError, parse_recipe


@pytest.mark.parametrize("label", ["int4-g33", "int4-g100", "int4-g7", "int3-g48-asym", "int2-g0"])
def test_unlisted_group_sizes_are_refused(label: str) -> None:
    with pytest.raises(ValueError, match="group size"):
        parse_encoding(label)


def test_every_listed_group_size_parses_and_is_in_the_help() -> None:
    assert GROUP_SIZES and all(MIN_GROUP_SIZE <= g <= MAX_GROUP_SIZE for g in GROUP_SIZES)
    for g in GROUP_SIZES:
        assert parse_encoding(f"int4-g{g}-asym").group_size == g
        assert f"g{g}" in encoding_help()


@pytest.mark.parametrize(
    ("quantize", "match"),
    [
        ({"encodings": ["int4-g33"]}, "group size 33"),
        ({"group_sizes": [48]}, "group size 48"),
        ({"group_sizes": [100]}, "group size 100"),
    ],
)
def test_recipe_refuses_unlisted_group_sizes(quantize: dict, match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        parse_recipe({"quantize": quantize})


@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]


def test_fallback_is_marked_per_tensor() -> None:
    tensors = [_Tensor("a.weight", (8, 256)), _Tensor("b.weight", (8, 96)), _Tensor("c", (5, 12))]
    plans = {p.name: p for p in plan_encodings(tensors, parse_encoding("int4-g128"), None)}
    assert not plans["a.weight"].fell_back and plans["a.weight"].choice.group_size == 128
    b = plans["b.weight"]
    assert b.fell_back and b.choice.group_size == 32 and "not divisible by 128" in b.reason
    c = plans["c"]
    assert c.fell_back and c.choice.encoding == Encoding.INT8_CHANNEL


def test_convert_reports_fallbacks_in_result_and_plan(tmp_path: Path) -> None:
    from runtime_fixtures import tiny_model_dir

    src = tiny_model_dir(tmp_path, hidden_size=96)  # rows of 96: no group of 64 fits
    result = convert(src, tmp_path / "m.epk", encoding="int4-g64")
    fallbacks = {p.name for p in result.fallbacks}
    assert "layers.0.attn_q.weight" in fallbacks
    with Package.open(tmp_path / "m.epk") as pkg:
        plan = json.loads(pkg.section(SectionKind.PRECISION_PLAN))["tensors"]
        assert "not divisible by 64" in plan["layers.0.attn_q.weight"]["reason"]
        assert pkg.entry("layers.0.attn_q.weight").group_size == 32
