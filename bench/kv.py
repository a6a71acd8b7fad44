"""KV cache quantization alone: every layout of ``runtime_shim.kv_cache.KV_LAYOUTS``
against the float cache, on the same float32 weights.

The package is its own reference (``edgepack.packager.evaluate`` with ``kv=LAYOUT`` and
``ref_kv="float"``, float activations), so the KL measures only what the KV cache
changes. Eval text: ``pydoc_data.topics`` sorted keys ``[40:]``, ctx 512 (the issue's
bar: 40 chunks). Prints per layout: bytes per token (all layers), the ratio to a float16
cache, mean KL against the float cache, top-1 agreement, and decode tok/s (greedy, 64
tokens after a 256-token prompt, the default kernels). ``--candidates N`` adds the
layouts tried on the way (K/V bit widths, V group sizes, symmetric or not, Hadamard
rotation), simulated by quantize-dequantize on write into a float cache, on N chunks
(KL only).

    edgepack convert $(edgepack fetch-sample smollm2) -o /tmp/kv/f32.epk --encoding f32
    python bench/kv.py /tmp/kv/f32.epk [--chunks 40] [--candidates 8]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from edgepack.packager.evaluate import default_eval_text, evaluate
from edgepack.runtime_shim import open as open_model
from edgepack.runtime_shim.kv_cache import KV_LAYOUTS, rotate_heads


def decode_speed(package: str, mode: str, kernels: str | None) -> float:
    """Greedy decode tok/s of 64 tokens after a 256-token prompt."""
    with open_model(package, kv=mode, kernels=kernels, verify="none") as model:
        prompt = model.tokenizer.encode(default_eval_text())[:256]
        s = model.session()
        list(s.generate(prompt, max_tokens=64))
        return s.stats.decode_tokens_per_s


# -- candidates: simulated by quantize-dequantize on write into a float cache -------------
def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _groups(x: np.ndarray, g: int) -> np.ndarray:
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def _sym(x: np.ndarray, bits: int, g: int) -> np.ndarray:
    """absmax/(2^(b-1)-1), f16 scale."""
    xg, qmax = _groups(x, g), (1 << (bits - 1)) - 1
    d = _f16(np.abs(xg).max(-1, keepdims=True) / qmax)
    inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
    return (np.clip(np.rint(xg * inv), -qmax, qmax) * d).reshape(x.shape)


def _peak(x: np.ndarray, bits: int, g: int) -> np.ndarray:
    """peak/-2^(b-1) (the weight codec's symmetric int4), f16 scale."""
    xg, lv = _groups(x, g), 1 << (bits - 1)
    peak = np.take_along_axis(xg, np.abs(xg).argmax(-1)[..., None], -1)
    d = _f16(peak / -lv)
    inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
    return (np.clip(np.rint(xg * inv), -lv, lv - 1) * d).reshape(x.shape)


def _asym(x: np.ndarray, bits: int, g: int) -> np.ndarray:
    """min/max, f16 scale and min."""
    xg, n = _groups(x, g), (1 << bits) - 1
    m = _f16(xg.min(-1, keepdims=True))
    d = _f16((xg.max(-1, keepdims=True) - m) / n)
    inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
    return (np.clip(np.rint((xg - m) * inv), 0, n) * d + m).reshape(x.shape)


def _rot(codec: Callable) -> Callable:
    """The codec applied to the Hadamard-rotated values, rotated back (layout "int8")."""
    return lambda x: rotate_heads(codec(rotate_heads(x)))


def _k8(k: np.ndarray) -> np.ndarray:
    return _sym(k, 8, k.shape[-1])


# name: (K codec, V codec, bytes per token and head at head_dim D)
CANDIDATES: dict[str, tuple[Callable | None, Callable | None, Callable[[int], float]]] = {
    "K int8/token, V f32": (lambda k: _sym(k, 8, k.shape[-1]), None, lambda d: d + 2 + 4 * d),
    "K f32, V int4 g32": (None, lambda v: _peak(v, 4, 32), lambda d: 4 * d + d / 2 + d / 16),
    "K int8, V int4 g16": (lambda k: _sym(k, 8, k.shape[-1]), lambda v: _peak(v, 4, 16),
                           lambda d: d + 2 + d / 2 + d / 8),
    "K int8, V int4 asym g16": (lambda k: _sym(k, 8, k.shape[-1]), lambda v: _asym(v, 4, 16),
                                lambda d: d + 2 + d / 2 + d / 4),
    "K int8, V int5 asym g64": (lambda k: _sym(k, 8, k.shape[-1]), lambda v: _asym(v, 5, 64),
                                lambda d: d + 2 + 5 * d / 8 + d / 16),
    "K int8, V int6/token": (lambda k: _sym(k, 8, k.shape[-1]), lambda v: _peak(v, 6, v.shape[-1]),
                             lambda d: d + 2 + 6 * d / 8 + 2),
    "K int8, V int8/token": (lambda k: _sym(k, 8, k.shape[-1]), lambda v: _sym(v, 8, v.shape[-1]),
                             lambda d: 2 * d + 4),
    "K int6/token, V f32": (lambda k: _sym(k, 6, k.shape[-1]), None,
                            lambda d: 6 * d / 8 + 2 + 4 * d),
    "K int8 g32, V f32": (lambda k: _sym(k, 8, 32), None, lambda d: d + d / 16 + 4 * d),
    # Hadamard-rotated K and V (rotate_heads), the road to the "int8" layout
    "rot K int8, V f32": (_rot(_k8), None, lambda d: d + 2 + 4 * d),
    "K f32, rot V int5 asym g32": (None, _rot(lambda v: _asym(v, 5, 32)),
                                   lambda d: 4 * d + 5 * d / 8 + d / 8),
    "rot K int8, V int5 asym g32": (_rot(_k8), lambda v: _asym(v, 5, 32),
                                    lambda d: d + 2 + 5 * d / 8 + d / 8),
    "rot K+V int8, int5 asym g32": (_rot(_k8), _rot(lambda v: _asym(v, 5, 32)),
                                    lambda d: d + 2 + 5 * d / 8 + d / 8),
    "rot K+V int8, int5 asym g64": (_rot(_k8), _rot(lambda v: _asym(v, 5, 64)),
                                    lambda d: d + 2 + 5 * d / 8 + d / 16),
    "rot K+V int8, int4 asym g32": (_rot(_k8), _rot(lambda v: _asym(v, 4, 32)),
                                    lambda d: d + 2 + d / 2 + d / 8),
    "rot K+V int8, int5 sym g32": (_rot(_k8), _rot(lambda v: _sym(v, 5, 32)),
                                   lambda d: d + 2 + 5 * d / 8 + d / 16),
    "rot K+V int7, int5 asym g32": (_rot(lambda k: _sym(k, 7, k.shape[-1])),
                                    _rot(lambda v: _asym(v, 5, 32)),
                                    lambda d: 7 * d / 8 + 2 + 5 * d / 8 + d / 8),
    "rot K+V int8, int6/token f16": (_rot(_k8), _rot(lambda v: _sym(v, 6, v.shape[-1])),
                                     lambda d: d + 2 + 6 * d / 8 + 2),
}  # fmt: skip


def candidate_kl(package: str, names: list[str], chunks: int) -> dict[str, tuple[float, float]]:
    """Mean KL and top-1 of each candidate against the float cache (numpy kernels)."""
    from edgepack.packager.evaluate import _log_softmax, _scored_logits, tokenize_for_eval

    ctx, out = 512, {}
    with open_model(package, kv="float", kernels="numpy", activations="float", verify="none") as m:
        tokens, bos = tokenize_for_eval(m, default_eval_text())
        write = m.kernels.kv_write
        codec: list = [None, None]

        def fake_write(kv, k, v, table, start):  # type: ignore[no-untyped-def]
            k = k if codec[0] is None else codec[0](k).astype(np.float32)
            v = v if codec[1] is None else codec[1](v).astype(np.float32)
            write(kv, k, v, table, start)

        m.kernels.kv_write = fake_write

        def chunk(c: int) -> np.ndarray:
            ids = tokens[c * ctx : (c + 1) * ctx]
            if bos is not None:
                ids[0] = bos
            return _log_softmax(_scored_logits(m, ids, ctx // 2))

        n = min(chunks, len(tokens) // ctx)
        refs = [chunk(c) for c in range(n)]
        for name in names:
            codec[:] = CANDIDATES[name][:2]
            kls, hits, total = [], 0, 0
            for c in range(n):
                lp, r = chunk(c), refs[c]
                kls.append((np.exp(r) * (r - lp)).sum(-1))
                hits += int((r.argmax(-1) == lp.argmax(-1)).sum())
                total += len(lp)
            out[name] = (float(np.concatenate(kls).mean()), hits / total)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("package")
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--candidates", type=int, default=0, metavar="N",
                    help="also the simulated candidate layouts, on N chunks")  # fmt: skip
    ap.add_argument("--kernels", default=None)
    ap.add_argument("--ref-cache", default="/tmp/kv/refcache")
    args = ap.parse_args()
    with open_model(args.package, kv="float", verify="none") as m:
        h, d, layers = m.config.num_kv_heads, m.config.head_dim, m.config.num_layers
    f16 = 2 * h * d * 2 * layers
    print(f"{args.package}: {layers} layers, {h} KV heads, head_dim {d}; "
          f"f16 cache {f16} B/token; KL on {args.chunks} chunks of 512")  # fmt: skip
    head = (f"{'layout':<26} {'B/token':>8} {'x f16':>6} {'mean KL':>9} {'top-1':>7} "
            f"{'decode tok/s':>13}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for name, layout in KV_LAYOUTS.items():
        per_token = layout.bytes_per_token_layer(h, d) * layers
        t0 = time.perf_counter()
        if name == "float":
            kl, top1 = 0.0, 1.0
        else:
            r = evaluate(args.package, ref=args.package, kv=name, ref_kv="float",
                         activations="float", chunks=args.chunks,
                         ref_cache=args.ref_cache)  # fmt: skip
            kl, top1 = r.kl_mean, r.top1
        tps = decode_speed(args.package, name, args.kernels)
        print(f"{name:<26} {per_token:>8} {per_token / f16:>6.3f} {kl:>9.5f} "
              f"{100 * top1:>6.2f}% {tps:>13.1f}   ({time.perf_counter() - t0:.0f} s)",
              flush=True)  # fmt: skip
    if args.candidates:
        print(f"simulated candidates (quantize-dequantize on write into a float cache, "
              f"{args.candidates} chunks):")  # fmt: skip
        res = candidate_kl(args.package, list(CANDIDATES), args.candidates)
        for name, (kl, top1) in res.items():
            per_token = CANDIDATES[name][2](d) * h * layers
            print(f"{name:<26} {per_token:>8.0f} {per_token / f16:>6.3f} {kl:>9.5f} "
                  f"{100 * top1:>6.2f}% {'-':>13}")  # fmt: skip


if __name__ == "__main__":
    main()
