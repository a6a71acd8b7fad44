"""A package tensor as GGUF data, only where GGUF stores the very same values.

The GGUF export promises that every tensor decodes (``gguf.quants.dequantize``) to the
float32 values the package's own decoder (:func:`edgepack.format.codecs.dequantize`)
gives, bit for bit. Both sides compute each value with the same float32 operations, so
an encoding maps when its codes and scales can be re-laid out as a GGUF block type:

* f32, f16, bf16 -> F32, F16, BF16 (the stored values as they are).
* int4 symmetric, group size a multiple of 32 -> Q4_0: value ``(q - 8) * d``, our
  nibble is ``q`` and our binary16 group scale is ``d`` (repeated per 32-block).
* int4 asymmetric, likewise -> Q4_1: value ``q * d + m``, our min is ``m``.
* The ``-s8`` forms of both: their 8-bit scales expand to binary16 (what our decoder
  multiplies by), which the block stores.
* int8 per channel -> Q8_0 when every row scale (float32) is a binary16 value and rows
  are whole 32-blocks: value ``q * d``.

Everything else (int3, int2, other group sizes, low-rank, int8 rows whose float32 scale
binary16 cannot hold) is refused with :class:`UnexportableError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from edgepack.format import codecs
from edgepack.format.encodings import Encoding, Family
from edgepack.format.header import TensorEntry
from edgepack.format.reader import QuantizedTensor

from .errors import UnexportableError

__all__ = ["EXPORTABLE", "GGUFTensor", "check_exportable", "gguf_tensor"]

_Q = gguf.GGMLQuantizationType
_BLOCK = 32  # elements of one Q4_0 / Q4_1 / Q8_0 block
_FLOAT_TYPES = {Encoding.F32: _Q.F32, Encoding.F16: _Q.F16, Encoding.BF16: _Q.BF16}
_INT4_TYPES = {True: _Q.Q4_0, False: _Q.Q4_1}  # by symmetry
# What the refusal lists: the encodings that map, and onto which GGUF type.
EXPORTABLE = (
    "f32/f16/bf16 as they are; int4-gN and int4-gN-s8 (N a multiple of 32) as Q4_0; "
    "int4-gN-asym and int4-gN-asym-s8 as Q4_1; int8 as Q8_0 where every row scale is a "
    "binary16 value"
)


@dataclass(frozen=True)
class GGUFTensor:
    """The data ``GGUFWriter.add_tensor`` takes: ``array`` (numpy order; raw blocks as
    uint8 ``[..., bytes per row]``) and its GGUF type."""

    array: np.ndarray
    qtype: gguf.GGMLQuantizationType


def _label(entry: TensorEntry) -> str:
    return entry.encoding.info.label(entry.group_size)


def _refuse(entry: TensorEntry, why: str) -> UnexportableError:
    return UnexportableError(
        f"tensor {entry.name!r} is {_label(entry)}, which GGUF cannot store exactly ({why}); "
        f"exportable: {EXPORTABLE}"
    )


def check_exportable(entry: TensorEntry, stored: np.ndarray | QuantizedTensor | None) -> None:
    """Raise :class:`UnexportableError` unless ``entry`` maps onto a GGUF type bit for bit;
    ``stored`` (:meth:`Package.tensor`; None for a low-rank entry) has the int8 scales."""
    info = entry.encoding.info
    if info.is_float:
        return
    if info.is_low_rank:
        raise _refuse(entry, "GGUF has no factored tensors")
    cols = int(np.prod(entry.shape[1:], dtype=np.int64)) if len(entry.shape) > 1 else 0
    if len(entry.shape) != 2 or cols % _BLOCK:
        raise _refuse(entry, f"rows must be whole {_BLOCK}-element blocks of a 2-D tensor")
    if info.family is Family.CHANNEL:
        _f16_row_scales(entry, stored)
        return
    if info.bits != 4:
        raise _refuse(entry, f"GGUF has no {info.bits}-bit block type with one scale per group")
    if entry.group_size % _BLOCK:
        raise _refuse(entry, f"groups of {entry.group_size} do not split into {_BLOCK}-blocks")


def gguf_tensor(entry: TensorEntry, stored: np.ndarray | QuantizedTensor) -> GGUFTensor:
    """``stored`` (what :meth:`Package.tensor` returns for ``entry``) as GGUF data."""
    check_exportable(entry, stored)
    if isinstance(stored, np.ndarray):
        return GGUFTensor(np.ascontiguousarray(stored), _FLOAT_TYPES[entry.encoding])
    if entry.encoding.info.family is Family.CHANNEL:
        return _q8_0(entry, stored)
    return _q4(entry, stored)


def _f16_row_scales(entry: TensorEntry, stored: QuantizedTensor) -> np.ndarray:
    """The int8 row scales as binary16, if each float32 one is a binary16 value."""
    scales = np.asarray(stored.scales, np.float32)
    with np.errstate(over="ignore"):
        half = scales.astype(np.float16)
        inexact = half.astype(np.float32) != scales
    if inexact.any():
        row = int(np.argmax(inexact))
        scale = float(scales[row])
        raise _refuse(entry, f"row {row}'s float32 scale {scale:.9g} is not a binary16 value")
    return half


def _q8_0(entry: TensorEntry, stored: QuantizedTensor) -> GGUFTensor:
    half = _f16_row_scales(entry, stored)
    rows, cols = stored.codes.shape
    blocks = np.empty((rows, cols // _BLOCK, 2 + _BLOCK), np.uint8)
    blocks[..., :2] = np.repeat(half[:, None], cols // _BLOCK, axis=1)[..., None].view(np.uint8)
    blocks[..., 2:] = stored.codes.reshape(rows, cols // _BLOCK, _BLOCK).view(np.uint8)
    return GGUFTensor(blocks.reshape(rows, -1), _Q.Q8_0)


def _q4(entry: TensorEntry, stored: QuantizedTensor) -> GGUFTensor:
    """Q4_0 / Q4_1 blocks: ``d`` (and ``m``) as binary16, then 16 bytes of nibbles where
    byte ``j`` holds element ``j`` (low) and ``j + 16`` (high)."""
    scales, mins = stored.group_values()
    nibbles = codecs.unpack_nibbles(np.asarray(stored.codes))
    rows, cols = nibbles.shape
    nblocks = cols // _BLOCK
    per_group = entry.group_size // _BLOCK
    parts = [scales] if mins is None else [scales, mins]
    head = [np.repeat(np.asarray(p, np.float16), per_group, axis=1) for p in parts]
    q = nibbles.reshape(rows, nblocks, 2, _BLOCK // 2)
    packed = q[:, :, 0] | (q[:, :, 1] << 4)
    blocks = np.concatenate([*(h[..., None].view(np.uint8) for h in head), packed], axis=-1)
    return GGUFTensor(blocks.reshape(rows, -1), _INT4_TYPES[entry.encoding.is_symmetric])
