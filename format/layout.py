"""What bytes each encoding needs: the one place that knows sizes and dtypes of parts.

Both the writer (to lay out data) and the reader (to check every span length against
the shape before any view is made) use :func:`part_layout`, so they cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .constants import MAX_GROUP_SIZE, MIN_GROUP_SIZE
from .encodings import Encoding, Family

__all__ = ["S8_ROW_BYTES", "PartLayout", "TensorLayout", "as_matrix_shape", "tensor_layout"]

S8_ROW_BYTES = 4  # *_S8 scales/zeros rows start with a little-endian float32 multiplier


@dataclass(frozen=True)
class PartLayout:
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TensorLayout:
    codes: PartLayout | None
    scales: PartLayout | None
    zeros: PartLayout | None


def as_matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Quantized tensors are [rows, cols] with rows = shape[0] (output channels)."""
    if len(shape) < 2:
        raise ValueError(f"quantized tensors need at least 2 dimensions, got shape {shape}")
    return shape[0], math.prod(shape[1:])


@lru_cache(maxsize=4096)  # models repeat a handful of shapes; opening stays O(header)
def tensor_layout(encoding: Encoding, shape: tuple[int, ...], group_size: int = 0) -> TensorLayout:
    """Return the parts an encoding stores for a tensor of ``shape``.

    Raises ValueError with a user-readable reason when the combination is invalid.
    """
    rec = encoding.info
    if rec.is_float:
        return TensorLayout(PartLayout(np.dtype(rec.code_dtype), shape), None, None)
    if rec.is_low_rank:
        return TensorLayout(None, None, None)
    rows, cols = as_matrix_shape(shape)
    if rec.family is Family.CHANNEL:
        return TensorLayout(
            PartLayout(np.dtype(rec.code_dtype), (rows, cols)),
            PartLayout(np.dtype("<f4"), (rows,)),
            None,
        )
    if rec.is_group:
        g = group_size
        if g < MIN_GROUP_SIZE or g > MAX_GROUP_SIZE or g % 8:
            raise ValueError(f"group size {g} is not a multiple of 8 in [8, 4096]")
        if cols % g:
            raise ValueError(f"row length {cols} is not a multiple of the group size {g}")
        # int4: 2 codes a byte; int3: 8 codes in 3 bytes; int2: 4 codes a byte (g % 8 == 0)
        codes = PartLayout(np.dtype(rec.code_dtype), (rows, cols * rec.bits // 8))
        if rec.scale_bits == 8:  # per row: float32 multiplier, then int8 per group
            scales = PartLayout(np.dtype("u1"), (rows, S8_ROW_BYTES + cols // g))
        else:
            scales = PartLayout(np.dtype("<f2"), (rows, cols // g))
        zeros = None if rec.symmetric else scales
        return TensorLayout(codes, scales, zeros)
    raise ValueError(f"no layout for encoding {encoding!r}")
