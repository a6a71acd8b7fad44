"""`edgepack convert`: import a model and write it as a package with one uniform encoding.

Lossless repack (f32/f16/bf16) or round-to-nearest quantization. 1-D tensors (norms,
biases) stay float32; with int4 the token embedding and the (tied) output head are int8
unless told otherwise, as llama.cpp's Q4_0 does, because they dominate the error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from edgepack.format import (
    Encoding,
    ModelIdentity,
    PackageWriter,
    Provenance,
    SectionKind,
)
from edgepack.format.compat import parse_semver
from edgepack.format.errors import EdgepackError
from edgepack.format.names import check_name, slug_name
from edgepack.format.output_file import check_output_path
from edgepack.format.writer import PackageSizer
from edgepack.runtime_shim import runtime_version
from edgepack.runtime_shim.instrument import check_runnable

from .encode import GROUP_SIZES, EncodingChoice, encode_tensor, parse_encoding
from .errors import ImportModelError, InputError
from .importers import SourceModel, SourceTensor, open_source
from .importers.config import check_convertible
from .model_card import card_section, merge_card, source_card

__all__ = [
    "ConvertResult",
    "TensorPlan",
    "check_release_fields",
    "convert",
    "plan_encodings",
    "required_operators",
    "resolve_model_name",
]

EMBEDDING_NAMES = ("embed.weight", "output.weight")


@dataclass(frozen=True)
class TensorPlan:
    name: str
    choice: EncodingChoice
    reason: str
    fell_back: bool = False  # the asked encoding does not fit this tensor's rows


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    plans: list[TensorPlan]
    tensor_bytes: dict[str, int]  # by encoding label

    @property
    def fallbacks(self) -> list[TensorPlan]:
        """The tensors written in another encoding than asked, each with its reason."""
        return [p for p in self.plans if p.fell_back]


def resolve_model_name(given: str | None, source_name: str) -> str:
    """The package's model name: ``given`` checked by the rule ``publish`` applies, else
    the source's name, slugged into a valid one if need be (``Smollm2 135M`` ->
    ``smollm2-135m``); InputError for a bad ``given``."""
    if given is None:
        try:
            return check_name("model", source_name)
        except ValueError:
            return slug_name(source_name)
    try:
        return check_name("model", given)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def check_release_fields(model_version: str, min_runtime_version: str | None) -> None:
    """InputError naming the field when a version is not a semantic version."""
    for label, value in (
        ("model version", model_version),
        ("min runtime version", min_runtime_version),
    ):
        if value is not None:
            try:
                parse_semver(value)
            except ValueError as exc:
                raise InputError(f"{label}: {exc}") from None


def _fit_group(choice: EncodingChoice, cols: int) -> tuple[EncodingChoice, str]:
    """Keep the group size if it divides the row, else the largest smaller one that does."""
    if cols % choice.group_size == 0:
        return choice, "uniform"
    for g in sorted(GROUP_SIZES, reverse=True):
        if g < choice.group_size and cols % g == 0:
            return EncodingChoice(
                choice.encoding, g
            ), f"row length {cols} not divisible by {choice.group_size}: group {g}"
    return EncodingChoice(Encoding.INT8_CHANNEL), f"row length {cols} fits no group size: int8"


def plan_encodings(
    tensors: Sequence[SourceTensor], base: EncodingChoice, embedding: EncodingChoice | None
) -> list[TensorPlan]:
    plans = []
    for t in tensors:
        if len(t.shape) < 2:
            plans.append(TensorPlan(t.name, EncodingChoice(Encoding.F32), "1-D tensors stay f32"))
            continue
        choice, reason = base, "uniform"
        if t.name in EMBEDDING_NAMES:
            if embedding is not None:
                choice, reason = embedding, "--embedding-encoding"
            elif base.encoding.is_group:
                choice, reason = EncodingChoice(Encoding.INT8_CHANNEL), "embedding/head int8"
        if choice.encoding.is_group:
            choice, fit_reason = _fit_group(choice, math.prod(t.shape[1:]))
            if fit_reason != "uniform":
                plans.append(TensorPlan(t.name, choice, fit_reason, fell_back=True))
                continue
        plans.append(TensorPlan(t.name, choice, reason))
    return plans


def required_operators(architecture: str, encodings: set[Encoding]) -> list[tuple[str, int]]:
    ops = [(f"arch.{architecture}", 1)]
    ops += sorted((e.info.operator, 1) for e in encodings)
    return ops


def convert(
    src: str | Path,
    out: str | Path,
    *,
    encoding: str = "f32",
    embedding_encoding: str | None = None,
    signing_keys: Sequence[object] = (),
    min_runtime_version: str | None = None,
    model_version: str = "1.0.0",
    model_name: str | None = None,
    on_start: Callable[[int], None] | None = None,
    on_tensor: Callable[[str, int], None] | None = None,
    card: Mapping[str, tuple[str, str]] | None = None,
) -> ConvertResult:
    """Import ``src`` and write ``out``; returns the per-tensor plan and byte counts.

    ``model_name`` defaults to the source's name slugged (:func:`resolve_model_name`); a
    bad name or version raises InputError before the source is read.
    ``on_start(total_elements)`` and ``on_tensor(name, elements)`` drive a progress bar.
    ``card``: model-card fields the user gave (:func:`.model_card.card_overrides`), over
    those the source states.
    """

    check_release_fields(model_version, min_runtime_version)
    given_name = resolve_model_name(model_name, "") if model_name is not None else None
    source: SourceModel = open_source(src)
    check_output_path(out, [src, *source.source_files], overwrite=True)
    check_convertible(source.architecture, source.config)
    base = parse_encoding(encoding)
    embed = parse_encoding(embedding_encoding) if embedding_encoding else None
    plans = plan_encodings(source.tensors, base, embed)
    found = source_card(source.source_files, source.config.get("source_config"))
    card_sec = card_section(merge_card(found, dict(card or {})))
    identity = ModelIdentity(
        name=given_name or resolve_model_name(None, source.name),
        version=model_version,
        architecture=source.architecture,
        config={k: v for k, v in source.config.items() if k != "source_config"},
    )
    recipe = {"command": "convert", "encoding": encoding, "embedding_encoding": embedding_encoding}
    provenance = Provenance(
        tool="edgepack",
        tool_version=runtime_version(),
        source_name=", ".join(p.name for p in source.source_files),
        source_sha256=source.source_sha256,
        recipe=recipe,
    )
    ops = required_operators(source.architecture, {p.choice.encoding for p in plans})
    if on_start:
        on_start(sum(math.prod(t.shape) for t in source.tensors))
    tensor_bytes: dict[str, int] = {}
    meta = {
        "min_runtime_version": min_runtime_version or runtime_version(),
        "required_operators": ops,
        "provenance": provenance,
    }
    sizer = PackageSizer(identity, **meta)  # where the data starts: written in place, once
    for tensor, plan in zip(source.tensors, plans, strict=True):
        choice = plan.choice
        sizer.declare_tensor(tensor.name, choice.encoding, tensor.shape, choice.group_size)
    _add_sections(sizer, source, plans, card_sec)
    with PackageWriter(out, identity, data_offset=sizer.data_offset, **meta) as writer:
        for tensor, plan in zip(source.tensors, plans, strict=True):
            encoded = encode_tensor(tensor.load(), plan.choice, tensor.name)
            entry = writer.add_tensor(
                tensor.name,
                plan.choice.encoding,
                encoded.codes,
                encoded.scales,
                encoded.zeros,
                shape=encoded.shape,
                group_size=plan.choice.group_size,
            )
            label = plan.choice.label
            tensor_bytes[label] = tensor_bytes.get(label, 0) + entry.nbytes
            del encoded
            if on_tensor:
                on_tensor(tensor.name, math.prod(tensor.shape))
        _add_sections(writer, source, plans, card_sec)
        writer.finish(signing_keys)
    _check_opens(Path(out), source.name)
    return ConvertResult(Path(out), plans, tensor_bytes)


def _check_opens(path: Path, name: str) -> None:
    """The package must open with this runtime (config valid, every tensor the config
    implies present, none it would not read): otherwise it is removed and the source
    refused, so convert never leaves a package that runs wrong or not at all."""
    try:
        check_runnable(path)
    except EdgepackError as exc:
        path.unlink(missing_ok=True)
        raise ImportModelError(f"{name}: {exc}") from None


def _add_sections(
    writer: PackageSizer, source: SourceModel, plans: list[TensorPlan], card: tuple | None
) -> None:
    if card is not None:
        kind, data, name, media = card
        writer.add_section(kind, data, name=name, media_type=media)
    if source.tokenizer_json:
        writer.add_section(
            SectionKind.TOKENIZER,
            source.tokenizer_json.encode(),
            name="tokenizer.json",
            media_type="application/json",
        )
    if source.chat_template:
        writer.add_section(
            SectionKind.CHAT_TEMPLATE,
            source.chat_template.encode(),
            name="default",
            media_type="text/x-jinja2",
        )
    raw_config = source.config.get("source_config")
    if raw_config is not None:
        writer.add_section(
            SectionKind.MODEL_CONFIG,
            json.dumps(raw_config, sort_keys=True, default=str).encode(),
            name="source",
            media_type="application/json",
        )
    plan_doc = {
        "method": "uniform",
        "tensors": {p.name: {"encoding": p.choice.label, "reason": p.reason} for p in plans},
    }
    writer.add_section(
        SectionKind.PRECISION_PLAN,
        json.dumps(plan_doc, sort_keys=True).encode(),
        name="plan",
        media_type="application/json",
    )
