"""Import a GGUF file: metadata, canonical tensors (dequantized lazily), tokenizer.

The file is memory-mapped by ``gguf.GGUFReader``; each :meth:`SourceTensor.load` dequantizes
one tensor with ``gguf.quants.dequantize``, so peak memory is one float32 tensor. Every tensor
type the installed ``gguf`` package can dequantize is accepted; others fail at open time.
For ``general.architecture == "llama"`` the Q/K rows are un-permuted back to HF's layout
(see :mod:`.names`); Qwen2 GGUFs are written unpermuted and are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ..errors import ImportModelError
from .config import gguf_source_config, llama_config_from_gguf
from .gguf_tokenizer import tokenizer_json_from_gguf
from .names import canonical_from_gguf, canonical_sort_key, unpermute_qk
from .source import SourceModel, SourceTensor, sha256_of_files

__all__ = ["open_gguf", "read_gguf_metadata"]

_MAGIC = b"GGUF"
# Architectures that llama.cpp converts to its interleaved-RoPE Q/K row order.
_PERMUTED_ARCHS = frozenset({"llama"})
# Architectures imported under canonical Llama-family names.
_LLAMA_GGUF_ARCHS = frozenset({"llama", "qwen2"})
_Q = gguf.GGMLQuantizationType
_PLAIN_TYPES = {
    _Q.F32: np.float32,
    _Q.F16: np.float16,
    _Q.F64: np.float64,
    _Q.I8: np.int8,
    _Q.I16: np.int16,
    _Q.I32: np.int32,
    _Q.I64: np.int64,
}


def _scalar(value: np.ndarray, vtype: gguf.GGUFValueType) -> Any:
    if vtype == gguf.GGUFValueType.BOOL:
        return bool(value[0])
    if vtype == gguf.GGUFValueType.FLOAT32:
        return float(str(value[0]))  # shortest decimal that round-trips the float32: 1e-05
    return value[0].item()


def _field_value(field: Any) -> Any:
    """Decode one ``ReaderField`` without relying on newer ``gguf`` helpers."""
    types = list(field.types)
    if not types:
        return None
    str_t, arr_t = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    try:
        if types[0] == str_t:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        if types[0] != arr_t:
            return _scalar(field.parts[field.data[0]], types[0])
        if len(types) != 2:  # nested arrays: no key we use has them
            return None
        if types[1] == str_t:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return []
        values = np.concatenate([field.parts[i] for i in field.data])
        if types[1] == gguf.GGUFValueType.FLOAT32:
            return values.astype(np.float64).tolist()
        return values.tolist()
    except UnicodeDecodeError as exc:
        raise ImportModelError(f"GGUF metadata {field.name!r} is not valid UTF-8") from exc


def read_gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values."""
    fields = reader.fields.items()
    return {name: _field_value(f) for name, f in fields if not name.startswith("GGUF.")}


def _open_reader(path: Path) -> gguf.GGUFReader:
    try:
        with path.open("rb") as stream:
            magic = stream.read(4)
    except OSError as exc:
        raise ImportModelError(f"cannot read {path}: {exc.strerror}") from exc
    if magic != _MAGIC:
        raise ImportModelError(f"{path} is not a GGUF file (bad magic {magic!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # a parser of untrusted bytes: any failure means a bad file
        raise ImportModelError(f"{path} is a corrupt or truncated GGUF file ({exc})") from exc
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ImportModelError(f"{path} is truncated: tensor {t.name!r} ends past the file")
    return reader


def _check_dequantizable(qtype: gguf.GGMLQuantizationType, tensor: str, path: Path) -> None:
    if qtype in _PLAIN_TYPES:
        return
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except Exception as exc:  # NotImplementedError, or a codec that cannot run here
        raise ImportModelError(
            f"{path.name}: tensor {tensor!r} has type {qtype.name}, which the installed "
            f"gguf {getattr(gguf, '__version__', '')} package cannot dequantize"
        ) from exc


def _load(
    reader: gguf.GGUFReader,
    index: int,
    shape: tuple[int, ...],
    fix: Callable[[np.ndarray], np.ndarray] | None,
) -> np.ndarray:
    t = reader.tensors[index]
    if t.tensor_type in _PLAIN_TYPES:
        values = np.asarray(t.data)
    else:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
    values = values.reshape(shape)
    if fix is not None:
        values = fix(values)
    out = np.ascontiguousarray(values, dtype=np.float32)
    # Never hand out a view of the read-only memmap; dequantized arrays are already fresh.
    return out.copy() if np.may_share_memory(out, t.data) else out


def _qk_heads(canonical: str, cfg: dict[str, Any]) -> int | None:
    part = canonical.rsplit(".", 2)[-2] if canonical.startswith("layers.") else ""
    if part == "attn_q":
        return int(cfg["num_attention_heads"])
    if part == "attn_k":
        return int(cfg["num_key_value_heads"])
    return None


def open_gguf(path: str | Path) -> SourceModel:
    """Open a GGUF file as a :class:`SourceModel` (tensors are read on demand)."""
    path = Path(path)
    reader = _open_reader(path)
    meta = read_gguf_metadata(reader)
    arch = str(meta.get("general.architecture", "")) or "unknown"
    llama = arch in _LLAMA_GGUF_ARCHS

    names = [canonical_from_gguf(t.name) if llama else t.name for t in reader.tensors]
    if len(set(names)) != len(names):
        raise ImportModelError(f"{path.name}: two tensors map to the same canonical name")
    if llama:
        config = llama_config_from_gguf(meta, set(names), where=path.name)
    else:
        config = {"source_config": gguf_source_config(meta)}

    tensors, checked = [], set()
    for index, (t, name) in enumerate(zip(reader.tensors, names, strict=True)):
        if t.tensor_type not in checked:
            _check_dequantizable(t.tensor_type, t.name, path)
            checked.add(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        fix = None
        heads = _qk_heads(name, config) if arch in _PERMUTED_ARCHS else None
        if heads is not None:
            if shape[0] % (2 * heads):
                msg = f"{path.name}: {t.name} rows ({shape[0]}) do not split into {heads} heads"
                raise ImportModelError(msg)
            fix = partial(unpermute_qk, n_head=heads)
        loader = partial(_load, reader, index, shape, fix)
        tensors.append(SourceTensor(name, shape, t.tensor_type.name, loader))
    if llama:
        tensors.sort(key=lambda t: canonical_sort_key(t.name))

    return SourceModel(
        name=str(meta.get("general.name") or path.stem),
        architecture="llama" if llama else arch,
        config=config,
        tensors=tensors,
        tokenizer_json=tokenizer_json_from_gguf(meta),
        chat_template=meta.get("tokenizer.chat_template"),
        source_files=[path],
        source_sha256=sha256_of_files([path]),
    )
