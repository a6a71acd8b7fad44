"""LoRA adapters on the packaging side: import, bind to a base, pack, merge offline.

An adapter source is a PEFT folder (:mod:`.importers.peft`) or a package holding
LORA_ADAPTER sections (an adapter-only ``.epk``). Binding to a base encodes the factors
(int8 per channel by default) with the base's weights digest, after the same check the
runtime makes (:func:`edgepack.format.adapter.check_binding`), so an adapter that would
be refused on device is refused here first.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from edgepack.format import Encoding, ModelIdentity, Package, PackageWriter, Provenance, SectionKind
from edgepack.format.adapter import (
    LoraAdapter,
    LoraFactor,
    LoraTarget,
    check_binding,
    decode_adapter,
    encode_adapter,
)
from edgepack.format.constants import LORA_OPERATOR
from edgepack.format.output_file import check_output_path
from edgepack.format.weights_digest import weights_digest
from edgepack.format.writer import PackageSizer
from edgepack.runtime_shim import runtime_version

from .errors import ImportModelError, InputError
from .importers.peft import FloatAdapter, is_peft_dir, read_peft

__all__ = [
    "ADAPTER_MEDIA_TYPE",
    "AdapterSource",
    "adapter_payload",
    "add_adapter_sections",
    "base_shapes",
    "bound_adapters",
    "build_adapter_sources",
    "merged_delta",
    "pack_adapter",
    "parse_adapter_encoding",
    "read_adapter_source",
    "write_adapter_package",
]

ADAPTER_MEDIA_TYPE = "application/vnd.edgepack.lora"


@dataclass(frozen=True)
class AdapterSource:
    """What ``--adapter`` / ``merge-lora`` was given: float factors from PEFT, or
    encoded adapters (already bound to a base) from a package."""

    path: Path
    imported: FloatAdapter | None = None
    encoded: tuple[LoraAdapter, ...] = ()


def parse_adapter_encoding(label: str) -> Encoding:
    from edgepack.format.adapter import ADAPTER_ENCODINGS
    from edgepack.format.encodings import by_label

    found = by_label(label)
    if found is None or found[0].encoding not in ADAPTER_ENCODINGS:
        allowed = ", ".join(e.info.kind for e in ADAPTER_ENCODINGS)
        raise InputError(f"adapter encoding {label!r}: use one of {allowed}")
    return found[0].encoding


def read_adapter_source(
    path: str | os.PathLike[str], base_config: dict | None = None, family: str = "llama"
) -> AdapterSource:
    """Read a PEFT folder, a llama.cpp GGUF LoRA (q/k need ``base_config``'s head
    counts) or an adapter package; ImportModelError / InputError otherwise."""
    from .importers.gguf_lora import is_gguf_lora, read_gguf_lora

    path = Path(path)
    if is_peft_dir(path):
        return AdapterSource(path, imported=read_peft(path, family))
    if is_gguf_lora(path):
        return AdapterSource(path, imported=read_gguf_lora(path, base_config))
    if path.is_file():
        with Package.open(path) as pkg:
            payloads = [
                pkg.section(SectionKind.LORA_ADAPTER, s.name)
                for s in pkg.sections(SectionKind.LORA_ADAPTER)
            ]
        if not payloads:
            raise InputError(f"{path} holds no LoRA adapter")
        return AdapterSource(path, encoded=tuple(decode_adapter(p) for p in payloads if p))
    raise ImportModelError(f"{path}: neither a PEFT adapter folder nor an adapter package")


def adapter_payload(
    fa: FloatAdapter,
    base_digest: bytes,
    shapes: dict[str, tuple[int, ...]],
    encoding: Encoding = Encoding.INT8_CHANNEL,
    name: str | None = None,
) -> bytes:
    """The LORA_ADAPTER payload of ``fa`` bound to the base of ``base_digest`` whose
    tensor shapes are ``shapes`` (AdapterMismatchError when it does not fit)."""
    targets = tuple(
        LoraTarget(n, LoraFactor.encode(t.a, encoding), LoraFactor.encode(t.b, encoding), t.scale)
        for n, t in fa.targets.items()
    )
    adapter = LoraAdapter(name or fa.name, base_digest, fa.rank, fa.alpha, targets, fa.source)
    check_binding(adapter, base_digest, shapes)
    return encode_adapter(adapter)


def bound_adapters(
    source: AdapterSource,
    base_digest: bytes,
    shapes: dict[str, tuple[int, ...]],
    encoding: Encoding = Encoding.INT8_CHANNEL,
) -> list[bytes]:
    """Payloads of ``source`` for the base (``base_digest``, ``shapes``): PEFT factors
    encoded and bound; a package's adapters checked against the base as they are."""
    if source.imported is not None:
        return [adapter_payload(source.imported, base_digest, shapes, encoding)]
    for adapter in source.encoded:
        check_binding(adapter, base_digest, shapes)
    return [encode_adapter(a) for a in source.encoded]


def base_shapes(pkg: Package) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in pkg.header.tensors}


def write_adapter_package(
    out: str | os.PathLike[str],
    base: Package,
    payloads: Sequence[bytes],
    *,
    signing_keys: Sequence[object] = (),
    overwrite: bool = False,
    version: str | None = None,
) -> Path:
    """An adapter-only package: no tensors, the adapters as sections, the base's identity
    (so it is released and planned under the base's model; ``version`` replaces the
    base's: a release needs its own) and its own provenance."""
    out = Path(out)
    check_output_path(out, [base.path], overwrite=overwrite)
    identity: ModelIdentity = base.header.identity
    if version is not None:
        identity = replace(identity, version=version)
    provenance = Provenance(
        tool="edgepack", tool_version=runtime_version(), recipe={"command": "adapter"}
    )
    ops = [(f"arch.{identity.architecture}", 1), (LORA_OPERATOR, 1)]
    with PackageWriter(out, identity, required_operators=ops, provenance=provenance) as w:
        for payload in payloads:
            _add_payload(w, payload)
        w.finish(signing_keys)
    return out


def merged_delta(source: AdapterSource, name: str) -> np.ndarray | None:
    """``scale * B A`` every adapter of ``source`` adds to tensor ``name`` (None: none)."""
    deltas = []
    if source.imported is not None and name in source.imported.targets:
        t = source.imported.targets[name]
        deltas.append(np.float32(t.scale) * (t.b @ t.a))
    for adapter in source.encoded:
        deltas += [t.delta() for t in adapter.targets if t.name == name]
    if not deltas:
        return None
    return np.sum(deltas, axis=0, dtype=np.float32)


def pack_adapter(
    base_path: str | os.PathLike[str],
    adapter_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    encoding: Encoding = Encoding.INT8_CHANNEL,
    signing_keys: Sequence[object] = (),
    overwrite: bool = False,
    version: str | None = None,
) -> Path:
    """An adapter-only package of the adapter at ``adapter_path``, bound to the package
    at ``base_path`` (the first-class small release: it names its base by digest)."""
    with Package.open(base_path) as base:
        source = read_adapter_source(adapter_path, base.header.identity.config)
        payloads = bound_adapters(source, base.weights_digest, base_shapes(base), encoding)
        return write_adapter_package(
            out, base, payloads, signing_keys=signing_keys, overwrite=overwrite, version=version
        )


def build_adapter_sources(paths: Sequence[str | os.PathLike[str]]) -> tuple[AdapterSource, ...]:
    """``build --adapter`` inputs: PEFT folders (float factors). An adapter package is
    bound to the weights it was made for, which a build replaces: InputError."""
    sources = tuple(read_adapter_source(p) for p in paths)
    for s in sources:
        if s.imported is None:
            raise InputError(
                f"--adapter {s.path}: an adapter package is bound to its base's weights; "
                "give the PEFT folder it came from"
            )
    names = [s.imported.name for s in sources if s.imported is not None]
    if len(set(names)) != len(names):
        raise InputError(f"--adapter: two adapters are named alike ({', '.join(names)})")
    return sources


def add_adapter_sections(w: PackageSizer, sources: Sequence[AdapterSource]) -> None:
    """Append ``sources`` as LORA_ADAPTER sections bound to the tensors ``w`` holds
    (uncompressed: a sizer's placeholder digest then lays out the same bytes)."""
    tensors = w.tensors
    digest = weights_digest(tensors)
    shapes = {t.name: t.shape for t in tensors}
    for source in sources:
        for payload in bound_adapters(source, digest, shapes):
            _add_payload(w, payload)


def _add_payload(w: PackageSizer, payload: bytes) -> None:
    w.add_section(
        SectionKind.LORA_ADAPTER,
        payload,
        name=decode_adapter(payload).name,
        media_type=ADAPTER_MEDIA_TYPE,
        compress=False,  # the runtime reads it as stored
    )
