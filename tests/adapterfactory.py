"""Real PEFT LoRA adapters on a tiny transformers Llama, for the adapter tests.

``peft`` makes them (``get_peft_model`` + ``save_pretrained``); lora_B is re-drawn
non-zero (PEFT initialises it to zero, which would make every adapter a no-op). The
merged reference is PEFT's own ``merge_and_unload``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

VOCAB = 128
# a small LlamaForCausalLM: GQA (4 query heads on 2 KV heads), untied head, SwiGLU 2x
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
IDS = [int(i) for i in np.random.default_rng(1).integers(3, VOCAB, 40)]
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class PeftAdapter:
    path: Path
    merged_logits: np.ndarray  # transformers + peft, merged, on IDS


def base_model(root: Path):
    """The tiny HF folder at ``root / "base"`` and the torch model (reloaded fresh)."""
    from runtime_fixtures import hf_random_model

    src = root / "base"
    if not (src / "config.json").exists():
        hf_random_model(src, "LlamaConfig", CONFIG)
    return src


def make_peft_adapter(
    root: Path,
    name: str,
    seed: int,
    *,
    r: int = 4,
    alpha: float = 8.0,
    targets: list[str] | None = None,
    use_rslora: bool = False,
) -> PeftAdapter:
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    src = base_model(root)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_MODULES,
        lora_dropout=0.1,
        use_rslora=use_rslora,
    )
    pm = peft.get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in pm.named_parameters():
            if "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    pm.eval()
    out = root / name
    pm.save_pretrained(str(out))
    merged = pm.merge_and_unload()
    with torch.no_grad():
        logits = merged(torch.tensor([IDS])).logits[0].float().numpy()
    return PeftAdapter(out, logits)


def int8_base_and_adapter(root: Path) -> tuple[Path, Path]:
    """An int8 package of the tiny base and a packed PEFT adapter for it (seed 3): the
    pair the runtime's adapter tests load."""
    from edgepack.packager.adapters import pack_adapter
    from edgepack.packager.convert import convert

    base, adapter = root / "base-int8.epk", root / "adapter.epk"
    convert(base_model(root), base, encoding="int8")
    pack_adapter(base, make_peft_adapter(root, "peft", seed=3).path, adapter)
    return base, adapter


def write_peft(
    path: Path, spec: Any, seed: int = 0, r: int = 4, targets: tuple = ("q_proj", "v_proj")
) -> Path:
    """A PEFT LoRA folder in the layout PEFT saves (``targets`` of every layer's
    attention) for a ``TinyLlamaSpec`` model, written without peft (for CLI tests)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h = spec.hidden_size
    kv = spec.num_key_value_heads * (h // spec.num_attention_heads)
    rows = {"q_proj": h, "k_proj": kv, "v_proj": kv}
    tensors = {}
    for i in range(spec.num_hidden_layers):
        for mod in targets:
            key = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((r, h)).astype(np.float32) * 0.2
            b = rng.standard_normal((rows[mod], r)).astype(np.float32) * 0.2
            tensors[f"{key}.lora_B.weight"] = b
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": list(targets)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path
