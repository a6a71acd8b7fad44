"""Import safetensors weights: one ``.safetensors`` file or a Hugging Face model directory.

A directory needs ``config.json`` plus ``model.safetensors`` or a sharded
``model.safetensors.index.json``. Each shard is opened once with
``safetensors.safe_open(framework="numpy")`` (which validates the header and maps the file);
tensors are read one at a time. numpy has no bfloat16, so BF16 tensors are read as raw bytes
at the offsets from the header and widened to float32 (exact: bf16 is the top half of f32).

Llama-family checkpoints (``model_type`` llama, mistral, qwen2) get canonical names from
:mod:`.names`; other architectures (BERT...) keep their source names. A lone ``.safetensors``
file without a ``config.json`` beside it imports with architecture ``"unknown"``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from ..errors import ImportModelError
from .config import llama_config_from_hf
from .names import FUSED, LLAMA_FAMILY, canonical_from_hf, canonical_sort_key
from .source import SourceModel, SourceTensor, sha256_of_files

__all__ = ["open_hf_dir", "open_safetensors_file"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own cap
_NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_SUPPORTED = frozenset({*_NUMPY_DTYPES, "BF16"})


class _Shard:
    """One open safetensors file: its validated header and a safe_open handle."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.handle = safe_open(str(path), framework="numpy")
        except (SafetensorError, OSError, ValueError) as exc:
            raise ImportModelError(f"{path.name} is not a valid safetensors file: {exc}") from exc
        self.header, self.data_start = self._read_header(path)

    @staticmethod
    def _read_header(path: Path) -> tuple[dict[str, Any], int]:
        with path.open("rb") as stream:
            raw = stream.read(8)
            if len(raw) != 8:
                raise ImportModelError(f"{path.name} is truncated before its header")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise ImportModelError(f"{path.name} declares a {size}-byte header (corrupt)")
            try:
                header = json.loads(stream.read(size))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ImportModelError(f"{path.name} has a corrupt JSON header") from exc
        if not isinstance(header, dict):
            raise ImportModelError(f"{path.name} has a corrupt JSON header")
        header.pop("__metadata__", None)
        return header, 8 + size

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.handle.metadata() or {})

    def load(self, name: str) -> np.ndarray:
        entry = self.header[name]
        if entry["dtype"] == "BF16":
            begin, end = entry["data_offsets"]
            with self.path.open("rb") as stream:
                stream.seek(self.data_start + begin)
                raw = stream.read(end - begin)
            if len(raw) != end - begin:
                raise ImportModelError(f"{self.path.name} is truncated inside tensor {name!r}")
            wide = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            values = wide.view(np.float32).reshape(entry["shape"])
        else:
            values = self.handle.get_tensor(name)
        out = np.ascontiguousarray(values, dtype=np.float32)
        return out if out.flags.writeable else out.copy()


def _check_entry(shard: _Shard, name: str) -> tuple[tuple[int, ...], str]:
    entry = shard.header.get(name)
    if not isinstance(entry, dict) or "dtype" not in entry or "shape" not in entry:
        raise ImportModelError(f"{shard.path.name}: tensor {name!r} is missing or malformed")
    if entry["dtype"] not in _SUPPORTED:
        dtype = entry["dtype"]
        raise ImportModelError(f"{shard.path.name}: tensor {name!r} has unsupported dtype {dtype}")
    return tuple(int(d) for d in entry["shape"]), str(entry["dtype"])


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ImportModelError(f"cannot read {path.name}: {exc}") from exc


def _weight_files(directory: Path) -> tuple[dict[str, str], list[Path]]:
    """``tensor name -> shard file name`` plus the index file, if any."""
    index = directory / _INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ImportModelError(f"{_INDEX} has no weight_map")
        for shard in set(weight_map.values()):
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise ImportModelError(f"{_INDEX} names a shard outside the directory: {shard!r}")
        return weight_map, [index]
    single = directory / _SINGLE
    if single.is_file():
        return {name: _SINGLE for name in _Shard(single).header}, []
    raise ImportModelError(f"{directory} has neither {_SINGLE} nor {_INDEX}")


def _chat_template(directory: Path) -> tuple[str | None, list[Path]]:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), [jinja]
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None, []
    template = _read_json(config).get("chat_template")
    if isinstance(template, list):  # named templates: take "default", else the first
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return (template if isinstance(template, str) else None), [config]


def _build(
    name: str,
    raw_config: dict[str, Any] | None,
    weight_map: dict[str, str],
    directory: Path,
    extra_files: list[Path],
) -> SourceModel:
    shards = {file: _Shard(directory / file) for file in sorted(set(weight_map.values()))}
    model_type = str(raw_config.get("model_type", "")) if raw_config else ""
    llama = model_type in LLAMA_FAMILY
    if llama:
        config = llama_config_from_hf(raw_config or {}, set(weight_map))
    elif raw_config is not None:
        config = {**raw_config, "source_config": raw_config}
    else:
        metadata = next(iter(shards.values())).metadata if shards else {}
        config = {"source_config": metadata}

    tensors = []
    for source_name, file in weight_map.items():
        shard = shards[file]
        shape, dtype = _check_entry(shard, source_name)
        canonical = canonical_from_hf(source_name, model_type) if llama else source_name
        if canonical == "output.weight" and config.get("tie_word_embeddings"):
            continue  # a tied lm_head duplicates embed.weight
        load = partial(shard.load, source_name)
        if llama and config["family"] in ("gemma", "gemma2") and canonical.endswith("norm.weight"):
            load = partial(_plus_one, load)  # Gemma's RMSNorm scales by (1 + w)
        fused = FUSED.get(canonical.split(".", 2)[-1]) if llama else None
        if fused is not None:  # Phi-3: split into the projections the runtime runs
            tensors.extend(_split_rows(canonical, shape, dtype, load, fused, config))
            continue
        tensors.append(SourceTensor(canonical, shape, dtype, load))
    if llama:
        tensors.sort(key=lambda t: canonical_sort_key(t.name))
    if len({t.name for t in tensors}) != len(tensors):
        raise ImportModelError(f"{directory}: two tensors map to the same canonical name")

    tokenizer = directory / "tokenizer.json"
    tokenizer_json = tokenizer.read_text(encoding="utf-8") if tokenizer.is_file() else None
    template, template_files = _chat_template(directory) if raw_config is not None else (None, [])
    files = [
        *extra_files,
        *(s.path for s in shards.values()),
        *([tokenizer] if tokenizer_json is not None else []),
        *template_files,
    ]
    return SourceModel(
        name=name,
        architecture="llama" if llama else (model_type or "unknown"),
        config=config,
        tensors=tensors,
        tokenizer_json=tokenizer_json,
        chat_template=template,
        source_files=files,
        source_sha256=sha256_of_files(files),
    )


def _plus_one(load: Callable[[], np.ndarray]) -> np.ndarray:
    """``1 + w`` in float32, exactly what Gemma's norm multiplies by, stored as the weight."""
    return (np.float32(1) + load().astype(np.float32)).astype(np.float32)


def _split_rows(
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    load: Callable[[], np.ndarray],
    parts: tuple[str, ...],
    config: dict[str, Any],
) -> list[SourceTensor]:
    """A fused ``[q; k; v]`` or ``[gate; up]`` weight as its row blocks (each loads the
    whole tensor and keeps its rows: fused tensors are a layer's, not a model's, size)."""
    prefix = name.rsplit(".", 2)[0] + "."
    hd = config["head_dim"]
    if len(parts) == 3:
        rows = [config["num_attention_heads"] * hd, *[config["num_key_value_heads"] * hd] * 2]
    else:
        rows = [config["intermediate_size"]] * 2
    if len(shape) != 2 or sum(rows) != shape[0]:
        raise ImportModelError(f"{name} has shape {shape}, rows {rows} expected")
    out, r0 = [], 0
    for part, n in zip(parts, rows, strict=True):

        def block(r0: int = r0, n: int = n) -> np.ndarray:
            return np.ascontiguousarray(load()[r0 : r0 + n])

        out.append(SourceTensor(prefix + part, (n, shape[1]), dtype, block))
        r0 += n
    return out


def open_hf_dir(directory: str | Path) -> SourceModel:
    """Open a Hugging Face model directory (config.json + safetensors weights)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ImportModelError(f"{directory} has no config.json: not a Hugging Face model folder")
    raw = _read_json(config_path)
    if not isinstance(raw, dict):
        raise ImportModelError(f"{config_path} is not a JSON object")
    weight_map, index_files = _weight_files(directory)
    name = str(raw.get("_name_or_path") or directory.name)
    return _build(name, raw, weight_map, directory, [config_path, *index_files])


def open_safetensors_file(path: str | Path) -> SourceModel:
    """Open one ``.safetensors`` file; a ``config.json`` beside it supplies the architecture."""
    path = Path(path)
    config_path = path.parent / "config.json"
    raw = _read_json(config_path) if config_path.is_file() else None
    if raw is not None and not isinstance(raw, dict):
        raise ImportModelError(f"{config_path} is not a JSON object")
    weight_map = {name: path.name for name in _Shard(path).header}
    extra = [config_path] if raw is not None else []
    name = str((raw or {}).get("_name_or_path") or path.stem)
    return _build(name, raw, weight_map, path.parent, extra)
