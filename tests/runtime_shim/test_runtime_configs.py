"""Every Llama-family config the runtime implements, against transformers (torch CPU) on
a tiny random model made with transformers' own config classes; every config it does
not implement refused at convert with a typed one-line error naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_fixtures import cosine, hf_random_model

import edgepack.runtime_shim as rt
from edgepack.cli.exit_codes import EXIT_USAGE, exit_code_for
from edgepack.packager.convert import convert
from edgepack.runtime_shim.errors import UnsupportedModelError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 96
IDS = [int(i) for i in np.random.default_rng(1).integers(0, VOCAB, 40)]
BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "rope_theta": 10000.0,
    "beta_fast": 16,
    "original_max_position_embeddings": 32,
}
# name -> (transformers config class, overrides)
IMPLEMENTED: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-attention-bias": ("LlamaConfig", {"attention_bias": True}),
    "llama-mlp-bias": ("LlamaConfig", {"mlp_bias": True}),
    "llama-gelu": ("LlamaConfig", {"hidden_act": "gelu"}),
    "llama-gelu-tanh": ("LlamaConfig", {"hidden_act": "gelu_pytorch_tanh"}),
    "llama-relu": ("LlamaConfig", {"hidden_act": "relu"}),
    "llama-head-dim-16": (
        "LlamaConfig",
        {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16},
    ),
    "llama-head-dim-24": ("LlamaConfig", {"head_dim": 24}),
    # within the context limit (which open enforces) dynamic NTK is plain RoPE
    "llama-rope-dynamic": (
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ),
    "llama-rope-yarn": ("LlamaConfig", {"rope_parameters": YARN}),
    "llama-rope-yarn-mscale": (
        "LlamaConfig",
        {"rope_parameters": {**YARN, "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5}},
    ),
    "phi3-fused": ("Phi3Config", {}),
    "phi3-sliding": ("Phi3Config", {"sliding_window": 12, "num_key_value_heads": 4}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma-untied-gelu": (
        "GemmaConfig",
        {"head_dim": 32, "hidden_act": "gelu", "tie_word_embeddings": False},
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": 12,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 8.0,
            "final_logit_softcapping": 6.0,
        },
    ),
    "mistral-sliding-16": ("MistralConfig", {"sliding_window": 16}),
    "qwen2-sliding": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
    ),
    "qwen3-qk-norm": ("Qwen3Config", {"head_dim": 32}),
    "qwen3-sliding-bias": (
        "Qwen3Config",
        {
            "head_dim": 16,
            "attention_bias": True,
            "use_sliding_window": True,
            "sliding_window": 10,
            "max_window_layers": 0,
        },
    ),
}

# name -> (config class, overrides, the key the refusal names)
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama-rope-longrope": (
        "LlamaConfig",
        {"rope_parameters": {**YARN, "rope_type": "longrope", "short_factor": [1.0] * 8,
                             "long_factor": [2.0] * 8}},
        "rope",
    ),
    "gelu-10": ("LlamaConfig", {"hidden_act": "gelu_10"}, "hidden_act"),
    "gemma-bidirectional": (
        "GemmaConfig",
        {"head_dim": 16, "use_bidirectional_attention": True},
        "use_bidirectional_attention",
    ),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16}, "model_type"),
    "phi3-partial-rotary": ("Phi3Config", {"partial_rotary_factor": 0.5}, "rope_parameters"),
    "phi3-longrope": (
        "Phi3Config",
        {"rope_parameters": {**YARN, "rope_type": "longrope", "short_factor": [1.0] * 8,
                             "long_factor": [2.0] * 8}},
        "rope_parameters",
    ),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runtime-configs")


def _hf_model(root: Path, name: str, cls: str, overrides: dict[str, Any]) -> tuple[Path, Any]:
    """A tiny random model saved as an HF folder, and the torch model itself."""
    return root / name, hf_random_model(root / name, cls, {**BASE, **overrides})


def _reference(model: Any) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(IMPLEMENTED))
def test_config_matches_transformers(root: Path, name: str) -> None:
    cls, overrides = IMPLEMENTED[name]
    src, model = _hf_model(root, name, cls, overrides)
    ref = _reference(model)
    assert np.abs(ref).max() > 1.0  # not flat: a wrong op shows
    pkg = root / f"{name}.epk"
    convert(src, pkg, encoding="f32")
    for kernels in ("numpy", "native"):
        try:
            m = rt.open(pkg, kv="float", kernels=kernels)
        except rt.KernelUnavailableError:
            continue
        with m:
            ours = m.logits(IDS)
        err = float(np.abs(ours - ref).max())
        assert err < 1e-4, f"{name} on {kernels}: max abs error {err}"


def test_sliding_window_is_not_vacuous(root: Path) -> None:
    """The window tests above would catch a full-attention runtime."""
    _, windowed = _hf_model(root, "w-on", "MistralConfig", {"sliding_window": 16})
    _, full = _hf_model(root, "w-off", "MistralConfig", {"sliding_window": None})
    diff = np.abs(_reference(windowed) - _reference(full))
    assert diff[:16].max() < 1e-5 and diff[16:].max() > 1e-2


def test_head_dim_16_runs_with_default_settings(root: Path) -> None:
    cls, overrides = IMPLEMENTED["llama-head-dim-16"]
    src, model = _hf_model(root, "hd16-default", cls, overrides)
    pkg = root / "hd16-default.epk"
    convert(src, pkg, encoding="f32")
    ref = _reference(model)
    with rt.open(pkg) as m:  # default KV cache (quantized) and kernels
        ours = m.logits(IDS)
    assert ours.shape == ref.shape and np.isfinite(ours).all()
    assert cosine(ours, ref) > 0.9  # the quantized cache changes the answer a little


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_config_is_refused_at_convert(root: Path, name: str) -> None:
    cls, overrides, key = REFUSED[name]
    src, _ = _hf_model(root, f"refused-{name}", cls, overrides)
    out = root / f"refused-{name}.epk"
    with pytest.raises(UnsupportedModelError) as info:
        convert(src, out, encoding="f32")
    message = str(info.value)
    assert key in info.value.key and "\n" not in message and "not supported" in message
    assert "update" not in message  # no edgepack version runs it
    assert exit_code_for(info.value) == EXIT_USAGE
    assert not out.exists()


def test_bert_is_refused_at_convert(root: Path) -> None:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    src = root / "bert"
    transformers.BertModel(cfg).save_pretrained(src)
    with pytest.raises(UnsupportedModelError, match="model type 'bert'"):
        convert(src, root / "bert.epk", encoding="f32")


def test_yarn_is_not_vacuous(root: Path) -> None:
    """transformers applies the YaRN parameters the test above compares against."""
    _, yarn = _hf_model(root, "yarn-on", *IMPLEMENTED["llama-rope-yarn"])
    _, plain = _hf_model(root, "yarn-off", "LlamaConfig", {})
    assert np.abs(_reference(yarn) - _reference(plain)).max() > 1e-2


@pytest.mark.parametrize(
    "name", ["llama-gelu", "llama-relu", "gemma2", "qwen3-qk-norm", "qwen3-sliding-bias",
             "mistral-sliding-16", "llama-head-dim-24"],
)  # fmt: skip
def test_native_whole_layer_runs_every_supported_config(
    root: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """GELU/ReLU, sliding windows, score scale and soft-capping, q/k and sandwich norms and
    any V group of 8k run in the native whole layer (no chain of ops, no numpy attention),
    with the float cache and with the default one."""
    pkg = root / f"{name}-native.epk"
    if not pkg.exists():
        src, _ = _hf_model(root, f"{name}-native", *IMPLEMENTED[name])
        convert(src, pkg, encoding="f32")
    for kv in ("float", None):
        try:
            m = rt.open(pkg, kernels="native", **({} if kv is None else {"kv": kv}))
        except rt.KernelUnavailableError:
            pytest.skip("no native kernels")
        calls = []
        with caplog.at_level("INFO", logger="edgepack.runtime"), m:
            m.kernels.mod = _CountingLayer(m.kernels.mod, calls)
            m.logits(IDS[:20])
        assert calls, name
        assert "whole layer not used" not in caplog.text, caplog.text
        assert "attention on numpy" not in caplog.text, caplog.text


class _CountingLayer:
    """The native module with its decoder_layer calls counted."""

    def __init__(self, mod: Any, calls: list[int]) -> None:
        self._mod, self._calls = mod, calls

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._mod, attr)

    def decoder_layer(self, *args: Any) -> Any:
        self._calls.append(1)
        return self._mod.decoder_layer(*args)

    def Stack(self, *args: Any) -> Any:  # the one-call forward: whole layers too
        return _CountingStack(self._mod.Stack(*args), self._calls)


class _CountingStack:
    def __init__(self, stack: Any, calls: list[int]) -> None:
        self._stack, self._calls = stack, calls

    def run(self, *args: Any) -> Any:
        self._calls.append(1)
        return self._stack.run(*args)
