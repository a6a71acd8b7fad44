"""Tiny synthetic Llama checkpoints, written the way real tools write them, for tests.

``write_hf_llama`` writes an HF folder (config.json, safetensors, optionally sharded with
``model.safetensors.index.json``, optionally with BF16 tensors); ``write_gguf_llama`` writes
the same weights as a GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does: llama.cpp
names, Q/K rows permuted for interleaved RoPE (``llama`` arch only), chosen quant types and a
small byte-level BPE vocabulary. Importing both must give the same canonical model.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

from .names import permute_qk

__all__ = [
    "TinyLlamaSpec",
    "bf16_round",
    "tiny_bpe_vocab",
    "tiny_llama_weights",
    "write_gguf_llama",
    "write_hf_llama",
    "write_safetensors",
]

_Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the synthetic model; row sizes are multiples of 32 so every quant block fits."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 272
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"  # or "qwen2"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 512
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def tiny_llama_weights(spec: TinyLlamaSpec) -> dict[str, np.ndarray]:
    """Deterministic float32 weights under HF names (``model.layers.0.self_attn.q_proj.weight``)."""
    rng = np.random.default_rng(spec.seed)
    h, f, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_rows, kv_rows = spec.num_attention_heads * hd, spec.num_key_value_heads * hd

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    weights = {"model.embed_tokens.weight": mat(spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = 1 + mat(h)
        weights[p + "self_attn.q_proj.weight"] = mat(q_rows, h)
        weights[p + "self_attn.k_proj.weight"] = mat(kv_rows, h)
        weights[p + "self_attn.v_proj.weight"] = mat(kv_rows, h)
        if spec.attention_bias or spec.model_type == "qwen2":  # qwen2 always has them
            weights[p + "self_attn.q_proj.bias"] = mat(q_rows)
            weights[p + "self_attn.k_proj.bias"] = mat(kv_rows)
            weights[p + "self_attn.v_proj.bias"] = mat(kv_rows)
        weights[p + "self_attn.o_proj.weight"] = mat(h, q_rows)
        if spec.attention_bias and spec.model_type == "llama":  # llama's covers o_proj too
            weights[p + "self_attn.o_proj.bias"] = mat(h)
        weights[p + "post_attention_layernorm.weight"] = 1 + mat(h)
        weights[p + "mlp.gate_proj.weight"] = mat(f, h)
        weights[p + "mlp.up_proj.weight"] = mat(f, h)
        weights[p + "mlp.down_proj.weight"] = mat(h, f)
    weights["model.norm.weight"] = 1 + mat(h)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = mat(spec.vocab_size, h)
    return weights


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return rounded.view(np.float32)


def _bf16_bytes(x: np.ndarray) -> bytes:
    return (bf16_round(x).view(np.uint32) >> 16).astype("<u2").tobytes()


def write_safetensors(
    path: Path, tensors: Mapping[str, np.ndarray], bf16: frozenset[str] = frozenset()
) -> None:
    """Write a safetensors file by hand, so BF16 needs no torch: names in ``bf16`` go as BF16."""
    codes = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64"}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, array in tensors.items():
        if name in bf16:
            blob, dtype = _bf16_bytes(array), "BF16"
        else:
            blob, dtype = np.ascontiguousarray(array).tobytes(), codes[array.dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as stream:
        stream.write(struct.pack("<Q", len(raw)) + raw)
        for blob in blobs:
            stream.write(blob)


def write_hf_llama(
    directory: Path,
    spec: TinyLlamaSpec,
    shards: int = 1,
    bf16: frozenset[str] = frozenset(),
    extra: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write an HF folder; returns the HF-named weights as stored (BF16 ones rounded)."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = {**tiny_llama_weights(spec), **(extra or {})}
    config = {
        "architectures": ["Qwen2ForCausalLM" if spec.model_type == "qwen2" else "LlamaForCausalLM"],
        **{k: v for k, v in asdict(spec).items() if k not in ("seed", "attention_bias")},
        "head_dim": spec.head_dim,
        "rope_scaling": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "_name_or_path": f"synthetic/tiny-{spec.model_type}",
    }
    if spec.model_type != "qwen2":
        config["attention_bias"] = spec.attention_bias
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    names = list(weights)
    if shards == 1:
        write_safetensors(directory / "model.safetensors", weights, bf16)
    else:
        weight_map = {}
        for k in range(shards):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[k::shards]}
            write_safetensors(directory / file, part, bf16)
            weight_map.update(dict.fromkeys(part, file))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {n: bf16_round(w) if n in bf16 else w for n, w in weights.items()}


def tiny_bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, the 256 GPT-2 byte symbols, a few merges."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    merges = [
        "Ġ t",
        "h e",
        "Ġt he",
        "i n",
        "Ġ a",
        "e r",
        "o n",
        "Ġ s",
        "r e",
        "Ġ w",
        "a n",
        "Ġ Ġ",
        "ĠĠ ĠĠ",
    ]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, *(table[b] for b in range(256)), *(m.replace(" ", "") for m in merges)]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def write_gguf_llama(
    path: Path,
    spec: TinyLlamaSpec,
    weights: Mapping[str, np.ndarray],
    qtypes: Mapping[str, gguf.GGMLQuantizationType] | None = None,
    pre: str = "smollm",
    extra: Mapping[str, np.ndarray] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write HF-named ``weights`` as llama.cpp would; ``qtypes`` maps GGUF names to types (F32);
    ``metadata``: further string keys (``general.license``...)."""
    arch = "qwen2" if spec.model_type == "qwen2" else "llama"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_basename(f"tiny-{arch}")
    writer.add_block_count(spec.num_hidden_layers)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_attention_heads)
    writer.add_head_count_kv(spec.num_key_value_heads)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_uint32(f"{arch}.vocab_size", spec.vocab_size)
    tokens, types, merges = tiny_bpe_vocab()
    tokens += [f"<unused{i}>" for i in range(spec.vocab_size - len(tokens))]
    types += [4] * (spec.vocab_size - len(types))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")
    for key, value in (metadata or {}).items():
        writer.add_string(key, value)
    qtypes = qtypes or {}
    tensors = {_gguf_name(n): w for n, w in weights.items()}
    if arch == "llama":  # convert_hf_to_gguf.py LlamaModel.permute
        for name in list(tensors):
            if ".attn_q." in name:
                tensors[name] = permute_qk(tensors[name], spec.num_attention_heads)
            elif ".attn_k." in name:
                tensors[name] = permute_qk(tensors[name], spec.num_key_value_heads)
    tensors.update(extra or {})
    for name, array in tensors.items():
        qtype = qtypes.get(name, _Q.F32)
        if qtype == _Q.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif qtype == _Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
