"""Shared helpers for the runtime tests: tiny synthetic packages with a transformers
reference, SmolLM2 packages built once per test session, and the texts the bars use.

``pydoc_data.topics`` (stdlib) is the text source: sorted keys ``[:40]`` are the
calibration split, ``[40:]`` the evaluation split.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for a hub

_BUILT: dict[tuple, Path] = {}  # shared by every test module of the session


# Texts that trip tokenizers: whitespace runs, digits, unicode, special-token look-alikes.
TRICKY_TEXTS = [
    "",
    " ",
    "Hello world",
    "x  1",
    "  12345  678 9",
    "a1b22c333 4444\t55555\n666666",
    "3.14159 + 2,718 = 5.85987; 1e-10 0x1F 1_000_000",
    "\n\n\n   \t\t  \r\n  trailing   ",
    "I'm sure they'll say it's fine, don't you think? We've seen it. THEY'LL",
    "Café naïve résumé façade Ångström — “quotes” ‘single’ …",
    "你好，世界！这是一个测试。日本語のテキスト 한국어 Русский текст العربية",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ½ ² ٣ ৩ Ⅻ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>",
    "<|endoftext|><|endoftext|>x<repo_name>y<file_sep>",
    "<|im_start |> <|im_start|  not special",
    "def f(x):\n    return x ** 2  # comment\n\n\n\tpass",
    "\u00a0\u2003\u200b\ufeff zero width and nbsp",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "emoji 🙂👍🏽 and CJK 漢字かな",
]


def _topics() -> tuple[list[str], dict[str, str]]:
    import pydoc_data.topics as topics

    return sorted(topics.topics), topics.topics


def eval_text() -> str:
    keys, t = _topics()
    return "\n\n".join(t[k] for k in keys[40:])


def calibration_text() -> str:
    keys, t = _topics()
    return "\n\n".join(t[k] for k in keys[:40])


# -- tiny synthetic models ----------------------------------------------------------------
def tiny_spec(**overrides):
    from edgepack.packager.importers.synthetic import TinyLlamaSpec

    base = TinyLlamaSpec(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=288,
    )
    return replace(base, **overrides)


def tiny_model_dir(root: Path, rope_scaling: dict | None = None, **overrides) -> Path:
    """An HF folder of a tiny random Llama (or Qwen2 with ``model_type="qwen2"``)."""
    from edgepack.packager.importers.synthetic import write_hf_llama

    key = ("hf", tuple(sorted(overrides.items())), json.dumps(rope_scaling, sort_keys=True))
    if key in _BUILT:
        return _BUILT[key]
    d = root / f"hf-{len(_BUILT)}"
    write_hf_llama(d, tiny_spec(**overrides))
    if rope_scaling is not None:
        cfg = json.loads((d / "config.json").read_text())
        cfg["rope_scaling"] = rope_scaling
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    _BUILT[key] = d
    return d


def convert_to(root: Path, src: Path, encoding: str, name: str | None = None) -> Path:
    from edgepack.packager.convert import convert

    key = ("pkg", str(src), encoding)
    if key in _BUILT:
        return _BUILT[key]
    out = root / (name or f"{src.name}-{encoding}.epk")
    convert(src, out, encoding=encoding)
    _BUILT[key] = out
    return out


def repack(src: Path, out: Path, drop: tuple[str, ...] = (), **config) -> Path:
    """``src`` with its model config updated (a value of None removes the key) and the
    tensors in ``drop`` left out: what a buggy, older or hostile packager could write."""
    from edgepack.format import Package, PackageWriter

    with Package.open(src) as pkg:
        cfg = {**pkg.header.identity.config, **config}
        cfg = {k: v for k, v in cfg.items() if v is not None}
        identity = replace(pkg.header.identity, config=cfg)
        with PackageWriter(out, identity, required_operators=pkg.header.required_operators) as w:
            for t in pkg.header.tensors:
                if t.name not in drop:
                    w.add_tensor(t.name, t.encoding, pkg.dequantize(t.name))
            w.finish()
    return out


def hf_random_model(directory: Path, config_class: str, config: dict):
    """A tiny random model made with a transformers config class, saved to ``directory``;
    weights re-drawn (matrices N(0, 0.3), norms near their identity) so logits are not
    flat. Returns the torch model (eval mode, eager attention) for reference logits."""
    import torch
    import transformers

    cfg = getattr(transformers, config_class)(**config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    offset = 0.0 if config_class.startswith("Gemma") else 1.0  # Gemma's norms scale by 1 + w
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(0.2 * torch.randn_like(p) + offset)
            else:
                p.normal_(0.0, 0.3 if p.dim() > 1 else 0.2)
    model.eval()
    model.save_pretrained(directory)
    return model


def hf_logits(model_dir: Path, ids: list[int], gguf_file: str | None = None) -> np.ndarray:
    """float32 ``[T, vocab]`` logits from transformers on torch CPU (float32, eager)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.float32}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([ids], dtype=torch.long)).logits[0]
    return out.float().numpy()


# -- SmolLM2 ------------------------------------------------------------------------------
def smollm2_package(gguf: Path, root: Path, encoding: str) -> Path:
    """SmolLM2-135M converted with ``encoding``; built once per test session."""
    return convert_to(root, gguf, encoding, name=f"smollm2-{encoding}.epk")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


def native_runtime_module(needs: str = "quantize_act"):
    """The native extension when it has ``needs`` (a runtime kernel), else skip the test."""
    import pytest

    from edgepack import native

    mod = native.load()
    if mod is None or not hasattr(mod, needs):
        pytest.skip(f"native extension without {needs}")
    return mod


def kv_cache_args(pool) -> tuple[tuple, dict]:
    """Layer 0 of a KVPool as the native attention's cache arguments and keywords."""
    kv = pool.layer(0)
    kw = {"rotate": pool.layout.rotate}
    if kv.v_high is not None:
        kw["v_high"] = kv.v_high
    if kv.v_mins is not None:
        kw["v_mins"] = kv.v_mins
    return (kv.k, kv.k_scales, kv.v, kv.v_scales), kw


def tiny_package(factory, encoding: str) -> Path:
    """A tiny Llama converted to ``encoding`` in a fresh temporary folder."""
    root = factory.mktemp(f"tiny-{encoding}")
    return convert_to(root, tiny_model_dir(root), encoding)


def tied_tiny_gguf(path: Path, spec, metadata: dict[str, str] | None = None) -> Path:
    """A tiny Llama GGUF with a tied head (no ``output.weight``), as SmolLM2 ships."""
    from edgepack.packager.importers.synthetic import tiny_llama_weights, write_gguf_llama

    w = tiny_llama_weights(spec)
    w.pop("lm_head.weight", None)
    write_gguf_llama(path, spec, w, metadata=metadata)
    return path
