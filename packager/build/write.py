"""Phase 6's output: the package, sized exactly before it is written, then written once.

:func:`package_size` lays the package out (:class:`~edgepack.format.writer.PackageSizer`)
from the same calls :func:`write_package` makes, so the size target is checked before a
byte is written and the writer starts the data region at its final offset (no copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgepack.format import Encoding, PackageWriter, Provenance, SectionKind
from edgepack.format.writer import PackageSizer
from edgepack.runtime_shim import runtime_version

from ..convert import required_operators
from ..factorize import factor_names
from ..recipe import Recipe
from ..search import Plan
from ..sensitivity import TensorSensitivity
from .source import FloatModel

__all__ = ["PackageContent", "Sections", "package_size", "write_package"]

Sections = list[tuple[SectionKind, bytes, str, str]]  # kind, data, name, media type


@dataclass(frozen=True)
class PackageContent:
    """Everything that goes into the package, in the order it is written."""

    fm: FloatModel
    sens: list[TensorSensitivity]
    plan: Plan
    encoded: dict[tuple[str, str], Any]
    sections: Sections
    recipe: Recipe
    min_runtime_version: str | None = None  # None: this runtime
    adapters: tuple[Any, ...] = ()  # packager.adapters.AdapterSource, packed as sections


def _metadata(c: PackageContent) -> dict[str, Any]:
    """The writer's keyword arguments: runtime version, operators, provenance."""
    encs = {o.choice.encoding for o in c.plan.choices.values()}
    if any(o.rank for o in c.plan.choices.values()):
        encs.add(Encoding.LOW_RANK)
    ops = required_operators(c.fm.identity.architecture, encs)
    provenance = Provenance(
        tool="edgepack",
        tool_version=runtime_version(),
        source_name=c.fm.source_name,
        source_sha256=c.fm.source_sha256,
        recipe={"command": "build", **c.recipe.to_json()},
    )
    return {
        "min_runtime_version": c.min_runtime_version or runtime_version(),
        "required_operators": ops,
        "provenance": provenance,
    }


def _emit(w: PackageSizer, c: PackageContent) -> None:
    """Every tensor (a low-rank one as its two factors and the product's entry), then the
    sections, in file order."""
    for t in c.sens:
        opt = c.plan.choices[t.name]
        e = c.encoded[(t.name, opt.label)]
        parts = list(zip(factor_names(t.name), e, strict=True)) if opt.rank else [(t.name, e)]
        for name, part in parts:
            w.add_tensor(
                name,
                part.choice.encoding,
                part.codes,
                part.scales,
                part.zeros,
                shape=part.shape,
                group_size=part.choice.group_size,
            )
        if opt.rank:
            w.add_low_rank(t.name, t.shape, factor_names(t.name), opt.rank)
    for kind, data, name, media in c.sections:
        w.add_section(kind, data, name=name, media_type=media)
    if c.adapters:
        from ..adapters import add_adapter_sections

        add_adapter_sections(w, c.adapters)


def package_size(c: PackageContent, sign_keys: Sequence[object]) -> tuple[int, int]:
    """(file bytes, data region offset) of the package :func:`write_package` writes."""
    sizer = PackageSizer(c.fm.identity, **_metadata(c))
    _emit(sizer, c)
    return sizer.file_size(sign_keys), sizer.data_offset


def write_package(
    out: Path, c: PackageContent, sign_keys: Sequence[object], data_offset: int | None = None
) -> int:
    """Write the package at ``out`` (atomically: a temporary file renamed); its size."""
    with PackageWriter(out, c.fm.identity, data_offset=data_offset, **_metadata(c)) as w:
        _emit(w, c)
        w.finish(sign_keys)
    return out.stat().st_size
