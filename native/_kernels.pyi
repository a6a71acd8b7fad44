"""Type stub for the compiled ``edgepack.native._kernels`` (see native/src/module.cpp)."""

import numpy as np
import numpy.typing as npt

def quantize_int8_channel(
    w: npt.ArrayLike, *, threads: int = 2
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]: ...
def dequantize_int8_channel(
    codes: npt.NDArray[np.int8],
    scales: npt.NDArray[np.float32],
    *,
    out: npt.NDArray[np.float32] | None = None,
    threads: int = 2,
) -> npt.NDArray[np.float32]: ...
def quantize_int4_group(
    w: npt.ArrayLike, group_size: int, symmetric: bool, *, threads: int = 2
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float16], npt.NDArray[np.float16] | None]: ...
def dequantize_int4_group(
    codes: npt.NDArray[np.uint8],
    scales: npt.NDArray[np.float16],
    mins: npt.NDArray[np.float16] | None,
    group_size: int,
    *,
    out: npt.NDArray[np.float32] | None = None,
    threads: int = 2,
) -> npt.NDArray[np.float32]: ...
def cpu_features() -> dict[str, bool]: ...
def available_isas() -> list[str]: ...
def active_isa() -> str: ...
def set_isa(name: str) -> None: ...
