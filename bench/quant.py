"""Quantize/dequantize throughput: numpy reference vs native kernels, side by side.

GB/s is the float32 matrix size (rows * cols * 4 bytes) divided by the median time, for
quantize and dequantize alike, so the two directions are comparable.  Every native result
is also checked bit-identical to the numpy one.

    python bench/quant.py [--rows 4096] [--cols 4096] [--group 32] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from edgepack import native
from edgepack.format import codecs

Op = tuple[str, Callable[[], Any], Callable[[ModuleType, int], Any]]


def median_seconds(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    result = fn()  # warm-up, also the value checked against numpy
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b, strict=True))
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def build_ops(w: np.ndarray, g: int) -> list[Op]:
    c8, s8 = codecs.quantize_int8_channel(w)
    sym = codecs.quantize_int4_group(w, g, True)
    asym = codecs.quantize_int4_group(w, g, False)
    return [
        (
            "int8 quantize",
            lambda: codecs.quantize_int8_channel(w),
            lambda k, t: k.quantize_int8_channel(w, threads=t),
        ),
        (
            "int8 dequantize",
            lambda: codecs.dequantize_int8_channel(c8, s8),
            lambda k, t: k.dequantize_int8_channel(c8, s8, threads=t),
        ),
        (
            f"int4 sym g{g} quantize",
            lambda: codecs.quantize_int4_group(w, g, True),
            lambda k, t: k.quantize_int4_group(w, g, True, threads=t),
        ),
        (
            f"int4 sym g{g} dequantize",
            lambda: codecs.dequantize_int4_group(*sym, g),
            lambda k, t: k.dequantize_int4_group(*sym, g, threads=t),
        ),
        (
            f"int4 asym g{g} quantize",
            lambda: codecs.quantize_int4_group(w, g, False),
            lambda k, t: k.quantize_int4_group(w, g, False, threads=t),
        ),
        (
            f"int4 asym g{g} dequantize",
            lambda: codecs.dequantize_int4_group(*asym, g),
            lambda k, t: k.dequantize_int4_group(*asym, g, threads=t),
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per native case")
    ap.add_argument("--numpy-repeat", type=int, default=3, help="timed runs for numpy")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()

    w = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    gb = w.nbytes / 1e9
    kernels = native.load()
    isas = kernels.available_isas() if kernels else []
    print(f"matrix {args.rows}x{args.cols} f32 ({w.nbytes / 2**20:.0f} MiB), group {args.group}")
    if kernels:
        print(f"native ISAs: {', '.join(isas)} (default {kernels.active_isa()})")
    else:
        print("native kernels unavailable: numpy only")
    print(f"{'operation':<26}{'impl':<16}{'median ms':>10}{'GB/s':>8}{'vs numpy':>10}")
    default_isa = kernels.active_isa() if kernels else ""
    try:
        for name, ref_fn, native_fn in build_ops(w, args.group):
            t_ref, want = median_seconds(ref_fn, args.numpy_repeat)
            print(f"{name:<26}{'numpy':<16}{t_ref * 1e3:>10.1f}{gb / t_ref:>8.2f}{1.0:>9.2f}x")
            for isa in isas:
                assert kernels is not None
                kernels.set_isa(isa)
                for threads in args.threads:
                    run = lambda f=native_fn, t=threads: f(kernels, t)  # noqa: E731
                    t, got = median_seconds(run, args.repeat)
                    flag = "" if same(got, want) else "  MISMATCH vs numpy!"
                    label = f"{isa} t{threads}"
                    print(
                        f"{'':<26}{label:<16}{t * 1e3:>10.1f}{gb / t:>8.2f}{t_ref / t:>9.1f}x{flag}"
                    )
    finally:
        if kernels:
            kernels.set_isa(default_isa)


if __name__ == "__main__":
    main()
