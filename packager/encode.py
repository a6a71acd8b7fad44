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
from edgepack.format.encodings import REGISTRY, by_label

__all__ = ["EncodedTensor", "EncodingChoice", "encode_tensor", "parse_encoding"]


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


def parse_encoding(text: str) -> EncodingChoice:
    """``f32 | f16 | bf16 | int8 | int{4,3,2}-g{16,32,64,128}[-asym][-s8]`` -> EncodingChoice
    (``-s8``: 8-bit group scales, see spec/FORMAT.md; ``-sym`` may be spelled out)."""
    found = by_label(_SPELLED_SYM.sub(r"\1", text))
    if found is not None and not found[0].is_low_rank:
        rec, group_size = found
        return EncodingChoice(rec.encoding, group_size)
    simple = ", ".join(r.stem for r in _PARSEABLE if not r.is_group)
    stems = "|".join(dict.fromkeys(r.stem for r in _PARSEABLE if r.is_group))
    raise ValueError(
        f"unknown encoding {text!r}; use {simple} or {stems}-g16/g32/g64/g128[-asym][-s8]"
    )


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
