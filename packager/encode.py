"""Encode one float tensor into the format's parts, on native kernels when present.

The numpy codecs in edgepack.format.codecs are the definition; the native kernels are
bit-identical and faster (tests/test_native_quant.py), so either path gives the same file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from edgepack import native
from edgepack.format import Encoding, EncodingError, codecs
from edgepack.format.constants import MAX_GROUP_SIZE, MIN_GROUP_SIZE
from edgepack.format.encodings import REGISTRY, by_label

__all__ = [
    "GROUP_SIZES",
    "EncodedTensor",
    "EncodingChoice",
    "check_group_size",
    "encode_tensor",
    "encoding_help",
    "parse_encoding",
]

# Group sizes the packager writes: powers of two from the format's smallest group up to
# 128 (the format allows multiples of 8 up to MAX_GROUP_SIZE, but larger or odd groups
# only cost quality or SIMD speed, and a size the user did not list is never substituted).
_LARGEST_WRITTEN_GROUP = 128
GROUP_SIZES: tuple[int, ...] = tuple(
    g
    for g in (1 << k for k in range(MIN_GROUP_SIZE.bit_length() - 1, 13))
    if MIN_GROUP_SIZE <= g <= min(_LARGEST_WRITTEN_GROUP, MAX_GROUP_SIZE)
)


@dataclass(frozen=True)
class EncodingChoice:
    encoding: Encoding
    group_size: int = 0

    @property
    def label(self) -> str:
        return self.encoding.info.label(self.group_size)


@dataclass(frozen=True)
class EncodedTensor:
    choice: EncodingChoice
    shape: tuple[int, ...]
    codes: np.ndarray
    scales: np.ndarray | None = None
    zeros: np.ndarray | None = None


_SPELLED_SYM = re.compile(r"^(int\d+-g\d+)-sym(?=-s8$|$)")  # int4-g32-sym == int4-g32
_PARSEABLE = [r for r in REGISTRY if not r.is_low_rank]  # low-rank is a build result


def encoding_help() -> str:
    """The encodings :func:`parse_encoding` accepts, as ``--help`` and errors list them."""
    simple = " | ".join(r.stem for r in _PARSEABLE if not r.is_group)
    stems = "|".join(dict.fromkeys(r.stem for r in _PARSEABLE if r.is_group))
    groups = "|".join(f"g{g}" for g in GROUP_SIZES)
    return f"{simple} | {stems}-{groups}[-asym][-s8]"


def check_group_size(group_size: int) -> int:
    """``group_size`` if the packager writes it; ValueError naming the sizes otherwise."""
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"group size {group_size} is not supported; use one of "
            + ", ".join(str(g) for g in GROUP_SIZES)
        )
    return group_size


def parse_encoding(text: str) -> EncodingChoice:
    """An encoding label (:func:`encoding_help`) -> EncodingChoice; ValueError for any
    other text, a group size outside :data:`GROUP_SIZES` included (never substituted).
    ``-s8``: 8-bit group scales, see spec/FORMAT.md; ``-sym`` may be spelled out."""
    found = by_label(_SPELLED_SYM.sub(r"\1", text))
    if found is not None and not found[0].is_low_rank:
        rec, group_size = found
        if rec.is_group:
            try:
                check_group_size(group_size)
            except ValueError as exc:
                raise ValueError(f"encoding {text!r}: {exc}") from None
        return EncodingChoice(rec.encoding, group_size)
    raise ValueError(f"unknown encoding {text!r}; use {encoding_help()}")


def encode_tensor(w: np.ndarray, choice: EncodingChoice, name: str = "tensor") -> EncodedTensor:
    """Encode float32 ``w``; raises EncodingError (naming the tensor) on bad values."""
    shape = tuple(w.shape)
    try:
        return _encode(np.ascontiguousarray(w, dtype=np.float32), choice, shape)
    except EncodingError as exc:
        raise EncodingError(f"{name}: {exc}") from None


def _encode(w: np.ndarray, choice: EncodingChoice, shape: tuple[int, ...]) -> EncodedTensor:
    enc = choice.encoding
    if enc.is_float and not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0]
        raise EncodingError(f"non-finite value at index {tuple(int(i) for i in bad)}")
    if enc == Encoding.F32:
        return EncodedTensor(choice, shape, w)
    if enc == Encoding.F16:
        if np.abs(w).max(initial=0) > 65504:
            raise EncodingError("values overflow float16; use f32 or bf16")
        return EncodedTensor(choice, shape, w.astype(np.float16))
    if enc == Encoding.BF16:
        bits = w.view(np.uint32)
        rounded = bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))  # round half even
        return EncodedTensor(choice, shape, (rounded >> 16).astype(np.uint16))
    matrix = w.reshape(shape[0], -1) if w.ndim != 2 else w
    kernels = native.load()
    if enc == Encoding.INT8_CHANNEL:
        codes, scales = (kernels or codecs).quantize_int8_channel(matrix)
        return EncodedTensor(choice, shape, codes, scales)
    if enc.is_group:
        if enc.scale_bits == 8:
            codes, scales, zeros = codecs.quantize_group(
                matrix, enc.bits, choice.group_size, enc.is_symmetric, scale_bits=8
            )
        elif enc.bits == 4:
            codes, scales, zeros = (kernels or codecs).quantize_int4_group(
                matrix, choice.group_size, enc.is_symmetric
            )
        else:  # int3/int2: numpy reference only (no native encoder yet)
            codes, scales, zeros = codecs.quantize_group(
                matrix, enc.bits, choice.group_size, enc.is_symmetric
            )
        return EncodedTensor(choice, shape, codes, scales, zeros)
    raise ValueError(f"cannot encode as {enc.name}")
