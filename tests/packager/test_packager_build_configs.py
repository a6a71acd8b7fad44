"""`build` applies the config-key table too: families the runtime implements build and
open; one it does not is refused before any work, naming the key. `convert` leaves no
package whose tensors do not match its config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import hf_random_model

import edgepack.runtime_shim as rt
from edgepack.packager.build import build
from edgepack.packager.convert import convert
from edgepack.packager.errors import ImportModelError
from edgepack.packager.importers.synthetic import TinyLlamaSpec, write_hf_llama
from edgepack.packager.recipe import parse_recipe
from edgepack.runtime_shim.errors import UnsupportedModelError

pytest.importorskip("transformers")

CONFIG = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
RTN = {"quantize": {"encodings": ["int8"], "algorithm": "rtn", "scale_search": False}}


@pytest.mark.parametrize(
    "cls, extra",
    [("Qwen3Config", {}), ("Gemma2Config", {"sliding_window": 8, "query_pre_attn_scalar": 16})],
)
def test_build_of_an_implemented_family_runs(tmp_path: Path, cls: str, extra: dict) -> None:
    hf_random_model(tmp_path / "src", cls, {**CONFIG, **extra})
    out = build(tmp_path / "src", tmp_path / "b.epk", parse_recipe(RTN), report=False).path
    with rt.open(out, kernels="numpy") as m:
        logits = m.logits(list(range(3, 30)))
    assert logits.shape == (27, 96) and np.isfinite(logits).all()


def test_build_refuses_an_unsupported_family(tmp_path: Path) -> None:
    hf_random_model(tmp_path / "src", "Gemma3TextConfig", CONFIG)
    with pytest.raises(UnsupportedModelError, match="model_type") as info:
        build(tmp_path / "src", tmp_path / "b.epk", parse_recipe(RTN), report=False)
    assert info.value.key == "model_type" and not (tmp_path / "b.epk").exists()


def test_convert_refuses_a_checkpoint_without_the_tensors_its_config_implies(
    tmp_path: Path,
) -> None:
    """A Llama config with ``mlp_bias`` over a checkpoint without MLP biases: transformers
    would run random biases; convert refuses it and writes nothing."""
    import json

    src = tmp_path / "src"
    write_hf_llama(src, TinyLlamaSpec())
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "mlp_bias": True}))
    out = tmp_path / "b.epk"
    with pytest.raises(ImportModelError, match=r"ffn_gate\.bias"):
        convert(src, out, encoding="f32")
    assert not out.exists()
