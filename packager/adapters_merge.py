"""``edgepack merge-lora``: fold an adapter into a package's weights, offline.

Each adapted tensor is ``W + scale * B A`` with ``W`` the source's float weights when
``source`` is given (no quantization error compounds), else the base's dequantized ones,
then re-encoded in the tensor's own encoding and group size (the base's precision plan
stays). Every other tensor keeps its stored bytes. LORA_ADAPTER sections of the base are
dropped: they are bound to the old weights, which the merge changes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from edgepack.format import Encoding, Package, PackageWriter, SectionKind
from edgepack.format.output_file import check_output_path

from .adapters import AdapterSource, base_shapes, bound_adapters, merged_delta, read_adapter_source
from .encode import EncodingChoice, encode_tensor
from .errors import InputError

__all__ = ["MergeResult", "merge_lora"]


@dataclass(frozen=True)
class MergeResult:
    path: Path
    merged: list[str]  # tensors the adapter changed
    dropped_adapters: list[str]  # the base's adapter sections, now stale
    from_source: bool


def merge_lora(
    base_path: str | os.PathLike[str],
    adapter_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    source: str | os.PathLike[str] | None = None,
    signing_keys: Sequence[object] = (),
    overwrite: bool = False,
) -> MergeResult:
    out = Path(out)
    inputs = [Path(base_path), Path(adapter_path)] + ([Path(source)] if source else [])
    check_output_path(out, inputs, overwrite=overwrite)
    with Package.open(base_path) as base:
        adapter = read_adapter_source(adapter_path, base.header.identity.config)
        shapes = base_shapes(base)
        bound_adapters(adapter, base.weights_digest, shapes)  # refuse before writing
        floats = _source_tensors(source, shapes) if source is not None else {}
        merged, dropped = _write(base, adapter, floats, out, signing_keys)
    return MergeResult(out, merged, dropped, source is not None)


def _source_tensors(source: str | os.PathLike[str], shapes: dict) -> dict:
    from .importers import open_source

    model = open_source(source)
    tensors = {t.name: t for t in model.tensors}
    for name, t in tensors.items():
        if name in shapes and tuple(t.shape) != tuple(shapes[name]):
            raise InputError(
                f"--source {source}: {name} is {t.shape}, the base's is {shapes[name]}"
            )
    return tensors


def _write(
    base: Package, adapter: AdapterSource, floats: dict, out: Path, signing_keys: Sequence[object]
) -> tuple[list[str], list[str]]:
    h = base.header
    recipe = {"command": "merge-lora", "adapter": adapter.path.name, "base": base.path.name}
    provenance = replace(h.provenance, recipe=recipe)
    merged: list[str] = []
    with PackageWriter(
        out,
        h.identity,
        min_runtime_version=h.min_runtime_version,
        required_operators=h.required_operators,
        provenance=provenance,
    ) as w:
        for t in h.tensors:
            delta = merged_delta(adapter, t.name)
            if delta is None:
                w.copy_tensor(base, t.name)
                continue
            if t.encoding == Encoding.LOW_RANK:
                raise InputError(f"{t.name} is stored low-rank: merge into the --source weights")
            w_float = floats[t.name].load() if t.name in floats else base.dequantize(t.name)
            value = np.asarray(w_float, np.float32).reshape(t.shape) + delta
            e = encode_tensor(value, EncodingChoice(t.encoding, t.group_size), t.name)
            w.add_tensor(
                t.name, t.encoding, e.codes, e.scales, e.zeros,
                shape=t.shape, group_size=t.group_size,
            )  # fmt: skip
            merged.append(t.name)
        dropped = []
        for s in h.sections:
            if s.kind == SectionKind.LORA_ADAPTER:
                dropped.append(s.name)
                continue
            data = base.section(s.kind, s.name)
            assert data is not None
            w.add_section(s.kind, data, name=s.name, media_type=s.media_type, required=s.required)
        w.finish(signing_keys)
    return merged, dropped
