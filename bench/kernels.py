"""Inference kernel throughput: native GEMV/GEMM per ISA and thread count vs numpy.

GEMV (T = 1) runs over SmolLM2-135M's matrix shapes with 30 distinct copies of each (one
per layer, as in a real decode step) so the weights stream from memory instead of sitting
in cache; GB/s counts the weight bytes read (codes + scales) and is compared with the
machine's read bandwidth measured here.  "tok/s eq" is the token rate the matmuls of the
whole model alone would allow (30 layers x q,k,v,o,gate,up,down + lm_head).  GEMM
(T = 8: a verify pass; 64 / 512: prefill) reports GOPS = 2 N K T / time.  numpy columns:
dequantize + matmul per call (what a pure-numpy path does) and matmul on weights
dequantized once (4x memory).

    python bench/kernels.py [--quick] [--isa avx512 ...] [--threads 1 2] [--repeat 5]
                            [--act-group 32]

The machine must be otherwise idle: with other busy processes the 2-thread figures
collapse (a descheduled worker stalls every op) and the bandwidth figures drop.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from edgepack.format import codecs
from edgepack.native import _kernels as k

LAYERS = 30
HIDDEN, KV, FFN, VOCAB = 576, 192, 1536, 49152
# (name, N, K, matrices per model)
SHAPES = [
    ("q/o 576x576", HIDDEN, HIDDEN, 2 * LAYERS),
    ("k/v 192x576", KV, HIDDEN, 2 * LAYERS),
    ("gate/up 1536x576", FFN, HIDDEN, 2 * LAYERS),
    ("down 576x1536", HIDDEN, FFN, LAYERS),
    ("lm_head 49152x576", VOCAB, HIDDEN, 1),
]


def timeit(fn: Callable[[], object], repeat: int, min_time: float = 0.05) -> float:
    """Median seconds per call over `repeat` batches (each at least min_time long)."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(min_time / one))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def read_bandwidth(threads: int, mb: int = 512) -> tuple[float, float]:
    """(native read GB/s with `threads`, numpy memcpy GB/s counting read + write)."""
    buf = np.ones(mb << 18, np.float32)  # mb MiB
    k.set_threads(threads)
    t = timeit(lambda: k._read_probe(buf), 5, 0.2)
    dst = np.empty_like(buf)
    tc = timeit(lambda: np.copyto(dst, buf), 3, 0.2)
    return buf.nbytes / t / 1e9, 2 * buf.nbytes / tc / 1e9


def make_weights(enc: str, N: int, K: int, copies: int, rng: np.random.Generator):
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    if enc == "int8":
        c, s = codecs.quantize_int8_channel(w)
        parts = (c, s, None, 0)
    else:
        c, s, _ = codecs.quantize_int4_group(w, 32, True)
        parts = (c, s, None, 32)
    # Distinct copies so a pass over them streams from memory like one decode step.
    return [
        k.Weight(
            parts[0].copy(),
            parts[1].copy(),
            None,
            "int4_sym" if enc != "int8" else "int8",
            parts[3],
        )
        for _ in range(copies)
    ], parts


def numpy_dequant_matmul(enc: str, parts, x: np.ndarray) -> np.ndarray:
    c, s, z, g = parts
    W = (
        codecs.dequantize_int8_channel(c, s)
        if enc == "int8"
        else codecs.dequantize_int4_group(c, s, z, g)
    )
    return x @ W.T


def bench_gemv(
    isas: list[str], thread_counts: list[int], repeat: int, quick: bool, ga: int
) -> None:
    rng = np.random.default_rng(0)
    print("\n== GEMV (T=1), weights streamed from memory: us per matrix | GB/s of weight bytes")
    cols = [f"{isa}/t{t}" for isa in isas for t in thread_counts]
    print(f"{'shape':<20}{'enc':<7}" + "".join(f"{c:>20}" for c in cols) + f"{'numpy deq+mm':>16}")
    model_time: dict[tuple[str, str], float] = {}
    for enc in ("int8", "int4g32"):
        kind = "int8" if enc == "int8" else "int4"
        for name, N, K, per_model in SHAPES:
            copies = 1 if N == VOCAB else (4 if quick else LAYERS)
            weights, parts = make_weights(enc, N, K, copies, rng)
            x = rng.standard_normal((1, K)).astype(np.float32)
            xq, xs = k.quantize_act(x, ga)
            nbytes = weights[0].nbytes
            row = f"{name:<20}{enc:<7}"
            for isa in isas:
                k.set_isa(isa)
                for t in thread_counts:
                    k.set_threads(t)

                    def run(ws=weights, xq=xq, xs=xs) -> None:
                        for w in ws:
                            k.linear_q8(xq, xs, ga, w)

                    reps = 1 if (isa == "scalar" and N == VOCAB) else repeat
                    sec = timeit(run, reps) / copies
                    model_time[(enc, f"{isa}/t{t}")] = (
                        model_time.get((enc, f"{isa}/t{t}"), 0.0) + sec * per_model
                    )
                    row += f"{sec * 1e6:>10.1f} {nbytes / sec / 1e9:>6.1f}GB/s"
            if N * K <= HIDDEN * FFN or not quick:
                sec = timeit(
                    lambda parts=parts, x=x, kind=kind: numpy_dequant_matmul(kind, parts, x),
                    3,
                )
                row += f"{sec * 1e6:>14.1f}us"
            print(row)
    print("\nmatmul-only decode rate for the whole model (tok/s eq = 1 / sum of GEMV times):")
    for enc in ("int8", "int4g32"):
        print(f"  {enc:<8}" + "".join(f"{c}: {1 / model_time[(enc, c)]:7.1f}   " for c in cols))


def bench_gemm(isas: list[str], threads: int, repeat: int, quick: bool, ga: int) -> None:
    rng = np.random.default_rng(1)
    k.set_threads(threads)
    print(f"\n== GEMM (prefill), {threads} threads: GOPS = 2*N*K*T / time")
    Ts = (8, 64) if quick else (8, 64, 512)  # 8: a prompt-lookup verify pass
    print(
        f"{'shape':<20}{'enc':<7}{'T':>5}"
        + "".join(f"{isa:>10}" for isa in isas)
        + f"{'np deq+mm':>11}{'np f32 mm':>11}"
    )
    for enc in ("int8", "int4g32"):
        kind = "int8" if enc == "int8" else "int4"
        for name, N, K, _ in SHAPES[:4]:
            weights, parts = make_weights(enc, N, K, 1, rng)
            W = numpy_dequant_matmul(
                "int8" if enc == "int8" else "int4", parts, np.eye(K, dtype=np.float32)
            ).T
            for T in Ts:
                x = rng.standard_normal((T, K)).astype(np.float32)
                xq, xs = k.quantize_act(x, ga)
                ops = 2 * N * K * T
                row = f"{name:<20}{enc:<7}{T:>5}"
                for isa in isas:
                    k.set_isa(isa)
                    if isa == "scalar" and T > 64:
                        row += f"{'-':>10}"
                        continue
                    sec = timeit(
                        lambda w=weights[0], xq=xq, xs=xs: k.linear_q8(xq, xs, ga, w), repeat
                    )
                    row += f"{ops / sec / 1e9:>10.1f}"
                sec = timeit(
                    lambda parts=parts, x=x, kind=kind: numpy_dequant_matmul(kind, parts, x),
                    3,
                )
                row += f"{ops / sec / 1e9:>11.1f}"
                sec = timeit(lambda W=W, x=x: x @ W.T, 3)
                row += f"{ops / sec / 1e9:>11.1f}"
                print(row)


def bench_ops(isa: str, threads: int, repeat: int) -> None:
    """Per-call cost of the non-matmul ops at decode (T=1) and prefill (T=512) sizes."""
    rng = np.random.default_rng(2)
    k.set_isa(isa)
    k.set_threads(threads)
    print(f"\n== other ops ({isa}, {threads} threads): us per call")
    w = rng.standard_normal(HIDDEN).astype(np.float32)
    nb, bs, hkv, d, hq = 64, 16, 3, 64, 9
    cache = (
        np.zeros((nb, bs, hkv, d), np.int8),
        np.zeros((nb, bs, hkv), np.float32),
        np.zeros((nb, bs, hkv, d // 2), np.uint8),
        np.zeros((nb, bs, hkv, d // 32), np.float16),
    )
    table = np.arange(nb, dtype=np.int32)
    kx = rng.standard_normal((512, hkv, d)).astype(np.float32)
    k.kv_write(kx, kx, *cache, table, 0)
    for T in (1, 512):
        x = rng.standard_normal((T, HIDDEN)).astype(np.float32)
        g = rng.standard_normal((T, FFN)).astype(np.float32)
        q = rng.standard_normal((T, hq, d)).astype(np.float32)
        pos = np.arange(T)
        ops = {
            "quantize_act": lambda x=x: k.quantize_act(x),
            "rmsnorm_quant": lambda x=x: k.rmsnorm_quant(x, w, 1e-5),
            "swiglu_quant": lambda g=g: k.swiglu_quant(g, g),
            "rope q": lambda q=q, pos=pos: k.rope(q, pos),
        }
        if T == 1:
            ops["attention_decode L=256"] = lambda q=q: k.attention_decode(
                q[0], kx[255], kx[255], *cache, table, 255
            )
        else:
            ops["attention_prefill 512"] = lambda q=q: k.attention_prefill(
                q, kx, kx, *cache, table, 0
            )
        print(
            f"  T={T}: " + "  ".join(f"{n} {timeit(f, repeat) * 1e6:.1f}" for n, f in ops.items())
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--isa", nargs="*", help="ISAs to run (default: all usable but scalar)")
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer shapes / copies (smoke run)")
    ap.add_argument(
        "--act-group", type=int, default=32,
        help="activation quantization group (runtime default 32; 0 = one scale per token)",
    )  # fmt: skip
    args = ap.parse_args()
    isas = args.isa or [i for i in k.available_isas() if i != "scalar"]
    previous = (k.active_isa(), k.get_threads())
    try:
        print(f"isas: {k.available_isas()} (active {previous[0]}), cpu: {k.cpu_features()}")
        for t in args.threads:
            bw, cp = read_bandwidth(t)
            print(
                f"memory: read {bw:.1f} GB/s with {t} thread(s) (native probe); "
                f"numpy memcpy {cp:.1f} GB/s (r+w)"
            )
        bench_gemv(isas, args.threads, args.repeat, args.quick, args.act_group)
        bench_gemm(isas, max(args.threads), args.repeat, args.quick, args.act_group)
        bench_ops(isas[-1], max(args.threads), args.repeat)
    finally:
        k.set_isa(previous[0])
        k.set_threads(previous[1])


if __name__ == "__main__":
    main()
