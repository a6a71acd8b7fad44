"""Decode speed with a LoRA adapter applied online against the bare base, same run.

    python bench/adapters.py [--package PKG] [--encoding int4-g32] [--rank 16]
                             [--tokens 64] [--runs 3] [--threads 2]

The adapter is rank ``--rank`` (random factors) on q/k/v/o of every layer of SmolLM2-135M
(converted once into ``$EDGEPACK_CACHE/bench-adapters/`` unless ``--package`` is given),
packed as an adapter-only package and loaded next to the base. Each run decodes
``--tokens`` tokens after a 32-token prompt in a base session, then in an adapter session
(alternating: a shared host drifts more than the difference measured); figures are medians.
Prints ``adapter decode ratio N`` (adapter tok/s / base tok/s; the bar is >= 0.85), then
the process RSS around switching between two adapters (a second one with other random
factors), in two sessions and within one: switching must not re-read or copy the base,
so it costs no more than the adapters' factors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_o")


def _package(args: argparse.Namespace) -> Path:
    if args.package:
        return Path(args.package)
    from edgepack.packager.convert import convert
    from edgepack.packager.sample_models import default_cache_dir, fetch_smollm2

    cache = default_cache_dir()
    root = Path(cache) / "bench-adapters"
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"smollm2-{args.encoding}.epk"
    if not path.exists():
        convert(fetch_smollm2(cache), path, encoding=args.encoding)
    return path


def _adapter(base: Path, rank: int, out: Path, seed: int = 0) -> Path:
    """A random rank-``rank`` adapter on q/k/v/o of every layer, as an adapter package."""
    from edgepack.format import Package
    from edgepack.packager.adapters import adapter_payload, base_shapes, write_adapter_package
    from edgepack.packager.importers.peft import FloatAdapter, FloatTarget

    rng = np.random.default_rng(seed)
    with Package.open(base) as pkg:
        shapes = base_shapes(pkg)
        fa = FloatAdapter("bench", rank, 2.0 * rank, "bench")
        for name, shape in shapes.items():
            if name.split(".")[-2] in TARGETS:
                out_f, in_f = shape
                a = rng.standard_normal((rank, in_f)).astype(np.float32) / np.sqrt(in_f)
                b = rng.standard_normal((out_f, rank)).astype(np.float32) * 0.01
                fa.targets[name] = FloatTarget(a, b, 2.0)
        payload = adapter_payload(fa, pkg.weights_digest, shapes)
        return write_adapter_package(out, pkg, [payload])


def _decode_rate(session, prompt: list[int], tokens: int) -> float:
    # plain decoding: prompt lookup would draft tokens and hide the per-token cost
    gen = session.generate(prompt, max_tokens=tokens, stop=[], output="ids", lookup=False)
    t0 = None
    n = 0
    for _ in gen:
        if t0 is None:
            t0 = time.perf_counter()  # after prefill and the first token
        n += 1
    return (n - 1) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    import edgepack.runtime_shim as rt

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--package")
    p.add_argument("--encoding", default="int4-g32")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    base = _package(args)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = _adapter(base, args.rank, Path(tmp) / "adapter.epk")
        with rt.open(base, verify="none", threads=args.threads) as model:
            model.stop_token_ids = lambda: set()  # decode exactly --tokens tokens
            handle = model.load_adapter(adapter)
            prompt = [int(i) for i in np.random.default_rng(1).integers(100, 1000, 32)]
            rates: dict[str, list[float]] = {"base": [], "adapter": []}
            for _ in range(args.runs):
                for key, pick in (("base", None), ("adapter", handle)):
                    with model.session(adapter=pick) as s:
                        rates[key].append(_decode_rate(s, prompt, args.tokens))
            kernels = model.kernel_path
            other = model.load_adapter(_adapter(base, args.rank, Path(tmp) / "other.epk", seed=2))
            switch = _switch_rss(model, handle, other, prompt)
            factors = handle.nbytes + other.nbytes
    base_rate = statistics.median(rates["base"])
    lora_rate = statistics.median(rates["adapter"])
    print(f"package {base.name}, kernels {kernels}, rank {args.rank} on q/k/v/o of every layer")
    print(f"base decode     {base_rate:8.1f} tok/s  (runs: {_fmt(rates['base'])})")
    print(f"adapter decode  {lora_rate:8.1f} tok/s  (runs: {_fmt(rates['adapter'])})")
    print(f"adapter decode ratio {lora_rate / base_rate:.3f}")
    print(f"adapter factors {_mib(handle.nbytes)} each; base file {_mib(base.stat().st_size)}")
    print("RSS " + ", ".join(f"{k} {_mib(v)}" for k, v in switch.items()))
    grown = max(switch.values()) - min(switch.values())
    print(f"adapter switch RSS change {_mib(grown)} (both adapters' factors: {_mib(factors)})")
    return 0


def _switch_rss(model, first, second, prompt: list[int]) -> dict[str, int]:
    """RSS after decoding with ``first``, then ``second`` in another session, then with
    the first session switched to ``second`` (every step decoded once before: warm)."""
    import psutil

    proc = psutil.Process()
    out: dict[str, int] = {}
    with model.session(adapter=first) as a, model.session(adapter=second) as b:
        for _ in range(2):  # the first round warms buffers; the second is measured
            out["session A"] = _rss_after(proc, a, prompt)
            out["session B"] = _rss_after(proc, b, prompt)
            a.use_adapter(second)
            out["A switched to B"] = _rss_after(proc, a, prompt)
            a.use_adapter(first)
    return out


def _rss_after(proc, session, prompt: list[int]) -> int:
    for _ in session.generate(prompt, max_tokens=8, stop=[], output="ids", lookup=False):
        pass
    return proc.memory_info().rss


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


if __name__ == "__main__":
    sys.exit(main())
