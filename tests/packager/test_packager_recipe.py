"""Recipes: TOML parsing, defaults, validation with the key named, budget overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgepack.format import Encoding
from edgepack.packager.recipe import Recipe, RecipeError, load_recipe, parse_recipe

FULL = """
[quantize]
encodings = ["int4", "int3-asym", "int2-g64-asym", "int8"]
group_sizes = [32, 128]
algorithm = "gptq"
act_order = false
damp = 0.02

[factorize]
enabled = true
ranks = [0.25]

[protect]
"embed\\\\.weight" = "int8"
"layers\\\\.0\\\\..*" = "int4-g32-asym"

[search]
target_bpw = 4.2
method = "greedy"

[calibration]
samples = 256
min_tokens = 8
max_tokens = 64

[kv_cache]
keys = "int8"
values = "int4"

[[prefixes]]
name = "system"
text = "You are helpful."

[[adapters]]
name = "style"
path = "adapters/style"
"""


def test_full_recipe(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text(FULL)
    r = load_recipe(p)
    labels = [c.label for c in r.quantize.candidates()]
    assert labels == [
        "int4-g32",
        "int4-g128",
        "int3-g32-asym",
        "int3-g128-asym",
        "int2-g64-asym",
        "int8",
    ]
    assert r.quantize.act_order is False and r.quantize.damp == 0.02
    assert r.protected("embed.weight").encoding == Encoding.INT8_CHANNEL
    assert r.protected("layers.0.attn_q.weight").label == "int4-g32-asym"
    assert r.protected("layers.10.attn_q.weight") is None
    assert r.search.target_bpw == 4.2 and r.search.method == "greedy"
    assert r.calibration.samples == 256
    assert r.prefixes[0].name == "system" and r.adapters[0].merge is False
    assert r.factorize.enabled and r.factorize.ranks == (0.25,)
    assert r.to_json()["protect"]["embed\\.weight"] == "int8"


def test_defaults() -> None:
    r = load_recipe(None)
    assert r == Recipe()
    assert r.quantize.algorithm == "gptq"
    labels = [c.label for c in r.quantize.candidates()]
    assert "int4-g32-asym" in labels and "int3-g32-s8" in labels and "int8" in labels


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"quantize": {"encodings": ["int5"]}}, "unknown encoding"),
        ({"quantize": {"group_sizes": [12]}}, "group size 12"),
        ({"quantize": {"algorithm": "magic"}}, "algorithm"),
        ({"quantize": {"act_order": "yes"}}, "true/false"),
        ({"quantize": {"bogus": 1}}, "unknown key"),
        ({"protect": {"(": "int8"}}, "bad protect regex"),
        ({"protect": {"x": "int9"}}, "protect"),
        ({"search": {"target_bpw": 4, "target_size": 10}}, "not both"),
        ({"search": {"method": "anneal"}}, "search method"),
        ({"calibration": {"min_tokens": 100, "max_tokens": 10}}, "min_tokens"),
        ({"kv_cache": {"values": "int2"}}, "kv_cache values"),
        ({"prefixes": [{"name": "a", "text": "x"}, {"name": "a", "text": "y"}]}, "unique"),
        ({"prefixes": [{"name": "a"}]}, "text"),
        ({"prefixes": [{"name": "a", "text": "x", "system": True}, {"name": "b", "text": "y"}]},
         "all system prompts or none"),
        ({"prefixes": [{"name": "a", "text": ""}]}, "text is empty"),
        ({"something": {}}, "unknown key"),
    ],
)
def test_bad_recipes_name_the_problem(data: dict, match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        parse_recipe(data)


def test_toml_errors(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[quantize\n")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(p)
    with pytest.raises(RecipeError, match="cannot read"):
        load_recipe(tmp_path / "missing.toml")


def test_budget_overrides() -> None:
    r = parse_recipe({"search": {"target_bpw": 4.0}})
    r2 = r.with_budget(target_size=1000)
    assert r2.search.target_size == 1000 and r2.search.target_bpw is None
    r3 = r.with_budget(latency_budget_ms=5.0, lut="lut.json")
    assert r3.search.target_bpw == 4.0 and r3.search.latency_budget_ms == 5.0
