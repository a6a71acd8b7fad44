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

__all__ = ["EncodedTensor", "EncodingChoice", "encode_tensor", "parse_encoding"]


@dataclass(frozen=True)
class EncodingChoice:
    encoding: Encoding
    group_size: int = 0

    @property
    def label(self) -> str:
        if self.encoding.is_group:
            suffix = "" if self.encoding.is_symmetric else "-asym"
            if self.encoding.scale_bits == 8:
                suffix += "-s8"
            return f"int{self.encoding.bits}-g{self.group_size}{suffix}"
        return {Encoding.INT8_CHANNEL: "int8"}.get(self.encoding, self.encoding.name.lower())


@dataclass(frozen=True)
class EncodedTensor:
    choice: EncodingChoice
    shape: tuple[int, ...]
    codes: np.ndarray
    scales: np.ndarray | None = None
    zeros: np.ndarray | None = None


_GROUP = re.compile(r"^int([234])-g(\d+)(-asym|-sym)?(-s8)?$")


def parse_encoding(text: str) -> EncodingChoice:
    """``f32 | f16 | bf16 | int8 | int{4,3,2}-g{16,32,64,128}[-asym][-s8]`` -> EncodingChoice
    (``-s8``: 8-bit group scales, see spec/FORMAT.md)."""
    simple = {
        "f32": Encoding.F32,
        "f16": Encoding.F16,
        "bf16": Encoding.BF16,
        "int8": Encoding.INT8_CHANNEL,
    }
    if text in simple:
        return EncodingChoice(simple[text])
    m = _GROUP.match(text)
    if m:
        enc = Encoding.group(int(m[1]), m[3] != "-asym", 8 if m[4] else 16)
        return EncodingChoice(enc, int(m[2]))
    raise ValueError(
        f"unknown encoding {text!r}; use f32, f16, bf16, int8 or "
        "int4|int3|int2-g16/g32/g64/g128[-asym][-s8]"
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
