"""Config values the fuzzer (bench/fuzz.py) found raising an untyped TypeError at open: a
list or a map where a name is looked up in a set (family, hidden_act, a RoPE type). Each
is a typed refusal now (issue 11 item 8)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from runtime_fixtures import convert_to, repack, tiny_model_dir

import edgepack.runtime_shim as rt
from edgepack.format import EdgepackError

UNHASHABLE = {
    "family-list": {"family": [1]},
    "family-map": {"family": {}},
    "act-list": {"hidden_act": [1]},
    "act-map": {"hidden_act": {}},
    "rope-type-list": {"rope_scaling": {"rope_type": ["linear"], "factor": 2.0}},
}


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("unhashable")
    return convert_to(root, tiny_model_dir(root), "f32")


@pytest.mark.parametrize("case", list(UNHASHABLE))
def test_an_unhashable_value_is_a_typed_refusal(good: Path, tmp_path: Path, case: str) -> None:
    config: dict[str, Any] = UNHASHABLE[case]
    pkg = repack(good, tmp_path / f"{case}.epk", **config)
    with pytest.raises(EdgepackError) as info:
        rt.open(pkg, kernels="numpy")
    assert next(iter(config)) in str(info.value) and "\n" not in str(info.value)
