"""``edgepack export``: a package as a GGUF file llama.cpp runs (architecture ``llama``).

The mirror image of the GGUF importer (:mod:`.importers.gguf_source`), reusing its
tables: tensor names (:func:`.importers.names.gguf_from_canonical`), hyperparameter keys
(:data:`.importers.config.GGUF_HPARAMS`), the vocabulary (:mod:`.export_gguf_vocab`) and
llama.cpp's Q/K row order (:func:`.importers.names.permute_qk`). Tensors keep their values
bit for bit (:mod:`.export_gguf_tensors` says which encodings can); anything GGUF cannot
hold exactly is refused before a byte is written, with :class:`UnexportableError`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from edgepack.format import Package, SectionKind
from edgepack.format.file_mode import seal_output
from edgepack.format.output_file import check_output_path, create_partial, remove_stale_partials

from .errors import UnexportableError
from .export_gguf_tensors import check_exportable, gguf_tensor
from .export_gguf_vocab import gguf_vocab_metadata
from .importers.config import GGUF_HPARAMS, GGUF_ROPE_SCALING
from .importers.names import gguf_from_canonical, permute_qk

__all__ = ["ExportReport", "export_gguf"]

_ARCH = "llama"
_FAMILIES = ("llama", "mistral")  # packages whose graph is llama.cpp's llama
# Config keys whose value must be one of these for llama.cpp's llama graph to compute
# what the package's config says (a missing key is its default, the first value).
_LLAMA_GRAPH: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "qk_norm": (False,),
    "sandwich_norms": (False,),
    "embedding_scale": (None,),
    "attention_scale": (None,),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "sliding_window": (None,),
    "layer_types": (None,),
}
_ROPE_TYPES = ("linear",)  # rope_scaling types llama.cpp reads from keys alone


@dataclass(frozen=True)
class ExportReport:
    path: Path
    tensors: int
    gguf_types: dict[str, int]  # GGUF type name -> tensors of that type
    bytes_written: int


def _check_graph(config: Mapping[str, Any], family: str) -> None:
    if family not in _FAMILIES:
        raise UnexportableError(
            f"the package is a {family} model; export writes llama.cpp's llama architecture "
            f"({', '.join(_FAMILIES)} packages)"
        )
    for key, allowed in _LLAMA_GRAPH.items():
        value = config.get(key, allowed[0])
        if value not in allowed:
            raise UnexportableError(f"config {key}={value!r} has no llama.cpp llama equivalent")
    scaling = config.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type") not in _ROPE_TYPES:
        raise UnexportableError(
            f"rope_scaling type {scaling.get('rope_type')!r} does not export "
            f"(exportable: none, {', '.join(_ROPE_TYPES)})"
        )


def _hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    """``llama.*`` key -> value (counts uint32, the rest float32), from the package config."""
    out: dict[str, Any] = {}
    for canonical, key in GGUF_HPARAMS.items():
        out[f"{_ARCH}.{key}"] = config[canonical]
    out[f"{_ARCH}.attention.value_length"] = config["head_dim"]
    out[f"{_ARCH}.rope.dimension_count"] = config["head_dim"]
    for canonical, key in GGUF_ROPE_SCALING.items():
        value = (config.get("rope_scaling") or {}).get(canonical)
        if value is not None:
            out[f"{_ARCH}.{key}"] = value
    return out


def _add_metadata(writer: gguf.GGUFWriter, values: Mapping[str, Any]) -> None:
    T = gguf.GGUFValueType
    for key, value in values.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_key_value(key, value, T.UINT32)
        elif isinstance(value, float):
            writer.add_key_value(key, value, T.FLOAT32)
        else:
            writer.add_string(key, str(value))


def _gguf_names(pkg: Package) -> dict[str, str]:
    """Package tensor name -> llama.cpp's; refuses a tensor llama.cpp has no name for."""
    names = {}
    for entry in pkg.header.tensors:
        name = gguf_from_canonical(entry.name)
        if name is None:
            raise UnexportableError(f"tensor {entry.name!r} has no llama.cpp llama name")
        names[entry.name] = name
    return names


def _qk_heads(name: str, config: Mapping[str, Any]) -> int | None:
    """Heads whose Q/K rows llama.cpp interleaves (its converter's permute), or None."""
    if name.endswith(".attn_q.weight") or name.endswith(".attn_q.bias"):
        return int(config["num_attention_heads"])
    if name.endswith(".attn_k.weight") or name.endswith(".attn_k.bias"):
        return int(config["num_key_value_heads"])
    return None


def _plan(pkg: Package) -> tuple[dict[str, str], dict[str, Any]]:
    """Everything checked before writing: names, encodings, graph, metadata."""
    ident = pkg.header.identity
    config = ident.config
    _check_graph(config, str(config.get("family") or ident.architecture))
    for entry in pkg.header.tensors:
        low_rank = entry.encoding.info.is_low_rank
        check_exportable(entry, None if low_rank else pkg.tensor(entry.name))
    names = _gguf_names(pkg)
    tok = pkg.section(SectionKind.TOKENIZER)
    if tok is None:
        raise UnexportableError("the package has no tokenizer, which llama.cpp needs")
    meta: dict[str, Any] = {"general.name": ident.name, "general.version": ident.version}
    if config.get("variant"):
        meta["general.basename"] = config["variant"]
    meta.update(_hparams(config))
    meta.update(gguf_vocab_metadata(tok.decode(), int(config["vocab_size"]), config))
    chat = pkg.section(SectionKind.CHAT_TEMPLATE)
    if chat is not None:
        meta["tokenizer.chat_template"] = chat.decode()
    return names, meta


def export_gguf(
    package: str | os.PathLike[str], out: str | os.PathLike[str], *, overwrite: bool = False
) -> ExportReport:
    """Write ``package`` as the GGUF ``out`` (through a temporary renamed into place)."""
    out = check_output_path(out, [package], overwrite=overwrite)
    with Package.open(package) as pkg:
        names, meta = _plan(pkg)
        config = pkg.header.identity.config
        writer = gguf.GGUFWriter(None, _ARCH)
        _add_metadata(writer, meta)
        types: Counter[str] = Counter()
        for entry in pkg.header.tensors:
            data = gguf_tensor(entry, pkg.tensor(entry.name))
            array = data.array
            heads = _qk_heads(entry.name, config)
            if heads is not None:  # whole rows move, so quantized blocks move unchanged
                array = permute_qk(array, heads)
            writer.add_tensor(names[entry.name], np.ascontiguousarray(array), raw_dtype=data.qtype)
            types[data.qtype.name] += 1
        size = _write(writer, out)
    return ExportReport(out, sum(types.values()), dict(types), size)


def _write(writer: gguf.GGUFWriter, out: Path) -> int:
    remove_stale_partials(out)
    fd, tmp = create_partial(out)
    os.close(fd)
    try:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "rb+") as f:
            seal_output(f)
        size = tmp.stat().st_size
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return size
