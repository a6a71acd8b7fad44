"""Adapter importers: a llama.cpp GGUF LoRA imports to the same factors as the PEFT
folder it was converted from (q/k rows unpermuted); unsupported PEFT kinds are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from adapterfactory import write_peft

from edgepack.format import Encoding, Package, SectionKind
from edgepack.format.adapter import decode_adapter
from edgepack.packager.adapters import pack_adapter
from edgepack.packager.convert import convert
from edgepack.packager.errors import ImportModelError
from edgepack.packager.importers.names import permute_qk
from edgepack.packager.importers.peft import read_peft
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)

SPEC = TinyLlamaSpec(hidden_size=64, intermediate_size=128, vocab_size=288)


def _gguf_lora(peft: Path, out: Path, alpha: float = 8.0) -> Path:
    """What convert_lora_to_gguf.py writes for ``peft``: llama.cpp names, q/k B permuted."""
    import gguf
    from safetensors.numpy import load_file

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    heads = {"q_proj": SPEC.num_attention_heads, "k_proj": SPEC.num_key_value_heads}
    for key, value in sorted(load_file(str(peft / "adapter_model.safetensors")).items()):
        layer = key.split(".layers.")[1].split(".")[0]
        mod = key.split(".self_attn.")[1].split(".")[0]
        part = "lora_a" if ".lora_A." in key else "lora_b"
        gname = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v"}[mod]
        if part == "lora_b" and mod in heads:
            value = permute_qk(value, heads[mod])
        w.add_tensor(f"blk.{layer}.{gname}.weight.{part}", np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapter-import")
    write_gguf_llama(root / "m.gguf", SPEC, tiny_llama_weights(SPEC))
    convert(root / "m.gguf", root / "m.epk")
    return root / "m.epk"


def _targets(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    adapter = decode_adapter(Package.open(path).section(SectionKind.LORA_ADAPTER))
    return {t.name: (t.a.values(), t.b.values(), t.scale) for t in adapter.targets}


def test_gguf_lora_matches_its_peft_source(base: Path, tmp_path: Path) -> None:
    peft = write_peft(tmp_path / "peft", SPEC, targets=("q_proj", "k_proj", "v_proj"))
    gg = _gguf_lora(peft, tmp_path / "lora.gguf")
    from_peft = pack_adapter(base, peft, tmp_path / "p.epk", encoding=Encoding.F32)
    from_gguf = pack_adapter(base, gg, tmp_path / "g.epk", encoding=Encoding.F32)
    want, got = _targets(from_peft), _targets(from_gguf)
    assert sorted(want) == sorted(got) and any(".attn_k." in n for n in want)
    for name, (a, b, s) in want.items():
        np.testing.assert_array_equal(got[name][0], a)
        np.testing.assert_array_equal(got[name][1], b)
        assert got[name][2] == pytest.approx(s)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"peft_type": "IA3"}, "only LORA"),
        ({"bias": "all"}, "biases"),
        ({"r": 0}, "positive"),
        ({"r": 2}, "rank 4"),
    ],
)
def test_unsupported_peft_is_refused(tmp_path: Path, extra: dict, match: str) -> None:
    peft = write_peft(tmp_path / "peft", SPEC)
    cfg = json.loads((peft / "adapter_config.json").read_text())
    (peft / "adapter_config.json").write_text(json.dumps({**cfg, **extra}))
    with pytest.raises(ImportModelError, match=match):
        read_peft(peft)
