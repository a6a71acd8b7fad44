"""Benchmark: how long does opening a package take, against safetensors and GGUF?

Builds llama-shaped synthetic models (30 layers x 9 tensors + embeddings = 273 f16
tensors) of about 100 MB and 2 GB, writes each as an edgepack package, a safetensors
file and a GGUF file (reused on later runs), then times, side by side:

* ``Package.open`` (preamble + header + digest + validation + mmap),
  ``safetensors.safe_open`` and ``gguf.GGUFReader`` - median of ``--runs`` opens, with a
  warm page cache and with the file's pages dropped first (``POSIX_FADV_DONTNEED``);
* the ratio of the 2 GB to the 100 MB open time (opening must be O(header));
* the RSS increase of this process while the 2 GB file is open.

Targets (exit status 1 if one fails): edgepack open < 10 ms for both sizes, ratio < 2,
RSS increase < 50 MB. ``--profile`` (automatic when the open target fails) prints where
``Package.open`` spends its time.

    python bench/open.py [--dir DIR] [--runs 21] [--sizes 100M,2G] [--no-others]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edgepack.format import Encoding, ModelIdentity, Package, PackageWriter

MB = 1_000_000
OPEN_TARGET_MS = 10.0
RATIO_TARGET = 2.0
RSS_TARGET_MB = 50.0


@dataclass(frozen=True)
class ModelSpec:
    """Llama-like dimensions: GQA with 4 query heads per kv head, 30 layers."""

    label: str
    hidden: int
    intermediate: int
    vocab: int = 32000
    layers: int = 30

    @property
    def kv(self) -> int:
        return self.hidden // 4

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        h, i, kv = self.hidden, self.intermediate, self.kv
        yield "token_embd.weight", (self.vocab, h)
        for n in range(self.layers):
            p = f"blk.{n}."
            yield p + "attn_norm.weight", (h,)
            yield p + "attn_q.weight", (h, h)
            yield p + "attn_k.weight", (kv, h)
            yield p + "attn_v.weight", (kv, h)
            yield p + "attn_output.weight", (h, h)
            yield p + "ffn_norm.weight", (h,)
            yield p + "ffn_gate.weight", (i, h)
            yield p + "ffn_up.weight", (i, h)
            yield p + "ffn_down.weight", (h, i)
        yield "output_norm.weight", (h,)
        yield "output.weight", (self.vocab, h)

    @property
    def nbytes(self) -> int:
        return sum(2 * int(np.prod(shape)) for _, shape in self.tensors())


SPECS = {
    "100M": ModelSpec("100M", hidden=320, intermediate=864),
    "2G": ModelSpec("2G", hidden=1664, intermediate=4480),
}


# ------------------------------------------------------------------ building the files


class TensorSource:
    """Deterministic f16 tensors cut from one random pool (cheap, not all zeros)."""

    def __init__(self) -> None:
        self._pool = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float16)

    def __call__(self, index: int, shape: tuple[int, ...]) -> np.ndarray:
        return np.resize(np.roll(self._pool, index), shape)


def build_all(spec: ModelSpec, directory: Path, others: bool) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"llama-{spec.label}"
    paths = {"edgepack": stem.with_suffix(".epk")}
    if others:
        paths["safetensors"] = stem.with_suffix(".safetensors")
        paths["gguf"] = stem.with_suffix(".gguf")
    marker = stem.with_suffix(".json")
    wanted = json.dumps(asdict(spec), sort_keys=True)
    fresh = marker.exists() and marker.read_text() == wanted
    source = TensorSource()
    writers: dict[str, Callable[[ModelSpec, Path, TensorSource], None]] = {
        "edgepack": write_edgepack,
        "safetensors": write_safetensors,
        "gguf": write_gguf,
    }
    for fmt, path in paths.items():
        if fresh and path.exists():
            continue
        print(f"  writing {path.name} ({spec.nbytes / MB:.0f} MB)...", flush=True)
        start = time.perf_counter()
        tmp = path.with_name(path.name + ".tmp")
        writers[fmt](spec, tmp, source)
        os.replace(tmp, path)
        print(f"    done in {time.perf_counter() - start:.1f} s", flush=True)
    marker.write_text(wanted)
    return paths


def write_edgepack(spec: ModelSpec, path: Path, source: TensorSource) -> None:
    identity = ModelIdentity(f"bench-llama-{spec.label}", "1.0.0", "llama", asdict(spec))
    with PackageWriter(path, identity) as w:
        for i, (name, shape) in enumerate(spec.tensors()):
            w.add_tensor(name, Encoding.F16, source(i, shape))


def write_safetensors(spec: ModelSpec, path: Path, source: TensorSource) -> None:
    """``safetensors.numpy.save_file`` when small; streamed (same bytes layout) when not.

    save_file needs every tensor in memory at once (plus a copy), too much at 2 GB.
    """
    if spec.nbytes < 512 * MB:
        from safetensors.numpy import save_file

        tensors = {name: source(i, shape) for i, (name, shape) in enumerate(spec.tensors())}
        save_file(tensors, str(path))
        return
    header: dict[str, object] = {}
    offset = 0
    for name, shape in spec.tensors():
        size = 2 * int(np.prod(shape))
        header[name] = {
            "dtype": "F16",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as out:
        out.write(len(blob).to_bytes(8, "little") + blob)
        for i, (_, shape) in enumerate(spec.tensors()):
            out.write(np.ascontiguousarray(source(i, shape), "<f2").data)


def write_gguf(spec: ModelSpec, path: Path, source: TensorSource) -> None:
    """gguf.GGUFWriter in its streaming mode: tensor infos first, then data one by one."""
    import gguf

    writer = gguf.GGUFWriter(None, "llama")
    writer.add_block_count(spec.layers)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.intermediate)
    for name, shape in spec.tensors():
        writer.add_tensor_info(name, shape, np.dtype(np.float16), 2 * int(np.prod(shape)))
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (_, shape) in enumerate(spec.tensors()):
        writer.write_tensor_data(source(i, shape))
    writer.close()


# ------------------------------------------------------------------ measuring


def open_edgepack(path: Path) -> Callable[[], object]:
    def run() -> object:
        pkg = Package.open(path)
        pkg.close()
        return pkg

    return run


def open_safetensors(path: Path) -> Callable[[], object]:
    from safetensors import safe_open

    def run() -> object:
        with safe_open(str(path), framework="numpy") as f:
            return list(f.keys())

    return run


def open_gguf(path: Path) -> Callable[[], object]:
    import gguf

    def run() -> object:
        return len(gguf.GGUFReader(path).tensors)

    return run


OPENERS = {"edgepack": open_edgepack, "safetensors": open_safetensors, "gguf": open_gguf}


def drop_page_cache(path: Path) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


@dataclass(frozen=True)
class Timing:
    warm: float  # ms, median wall time
    warm_cpu: float  # ms, median CPU time of this process (robust to a loaded machine)
    cold: float | None  # ms, median wall time with the file's pages dropped first


def measure(run: Callable[[], object], runs: int, path: Path) -> Timing:
    run()  # warm-up (imports, page cache)
    wall, cpu, cold = [], [], []
    for _ in range(runs):
        gc.collect()  # release mappings of the previous run before dropping pages
        start, cpu_start = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    for _ in range(runs):
        gc.collect()
        if not drop_page_cache(path):
            break
        start = time.perf_counter()
        run()
        cold.append(time.perf_counter() - start)
    return Timing(
        statistics.median(wall) * 1e3,
        statistics.median(cpu) * 1e3,
        statistics.median(cold) * 1e3 if cold else None,
    )


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def rss_increase_mb(fmt: str, path: Path) -> float:
    gc.collect()
    before = rss_mb()
    if fmt == "edgepack":
        handle: object = Package.open(path)
    elif fmt == "safetensors":
        from safetensors import safe_open

        handle = safe_open(str(path), framework="numpy")
    else:
        import gguf

        handle = gguf.GGUFReader(path)
    after = rss_mb()
    if isinstance(handle, Package):
        handle.close()
    del handle
    gc.collect()
    return after - before


def profile_open(path: Path, runs: int = 50) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(runs):
        Package.open(path).close()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
    stats.print_stats(18)
    return f"cProfile of {runs} x Package.open({path.name}):\n" + out.getvalue()


# ------------------------------------------------------------------ report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "edgepack-bench")
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--sizes", default="100M,2G", help=f"from {', '.join(SPECS)}")
    parser.add_argument("--no-others", action="store_true", help="skip safetensors and GGUF")
    parser.add_argument("--profile", action="store_true", help="profile Package.open")
    args = parser.parse_args(argv)
    specs = [SPECS[s] for s in args.sizes.split(",")]
    formats = ["edgepack"] if args.no_others else list(OPENERS)

    print(f"files in {args.dir}")
    paths = {spec.label: build_all(spec, args.dir, not args.no_others) for spec in specs}
    results: dict[tuple[str, str], Timing] = {}
    for spec in specs:
        for fmt in formats:
            path = paths[spec.label][fmt]
            results[spec.label, fmt] = measure(OPENERS[fmt](path), args.runs, path)

    print_table(specs, formats, paths, results, args.runs)
    big, small = specs[-1].label, specs[0].label
    ratios = {}
    if big != small:
        for f in formats:
            ratios[f] = results[big, f].warm / results[small, f].warm
        print(
            f"\nratio {big}/{small} (warm wall): "
            + ", ".join(f"{f} {r:.2f}x" for f, r in ratios.items())
        )
    rss = {f: rss_increase_mb(f, paths[big][f]) for f in formats}
    print(
        f"RSS increase while {big} is open: "
        + ", ".join(f"{f} {v:+.1f} MB" for f, v in rss.items())
    )

    checks = [
        (
            f"edgepack open < {OPEN_TARGET_MS:g} ms ({s.label}, warm)",
            results[s.label, "edgepack"].warm,
            OPEN_TARGET_MS,
            "ms",
        )
        for s in specs
    ]
    if "edgepack" in ratios:
        checks.append(
            (f"ratio {big}/{small} < {RATIO_TARGET:g}", ratios["edgepack"], RATIO_TARGET, "x")
        )
    checks.append((f"RSS increase < {RSS_TARGET_MB:g} MB", rss["edgepack"], RSS_TARGET_MB, "MB"))
    print("\ntargets:")
    failed = False
    for label, value, limit, unit in checks:
        ok = value < limit
        failed |= not ok
        print(f"  [{'PASS' if ok else 'FAIL'}] {label}: {value:.2f} {unit}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"  (load average {load:.1f} on {os.cpu_count()} CPUs: wall times on a busy "
        "machine exceed the CPU column)"
    )

    slow = any(results[s.label, "edgepack"].warm >= OPEN_TARGET_MS for s in specs)
    if args.profile or slow:
        print("\n" + profile_open(paths[big]["edgepack"]))
    return 1 if failed else 0


def print_table(
    specs: list[ModelSpec],
    formats: list[str],
    paths: dict[str, dict[str, Path]],
    results: dict[tuple[str, str], Timing],
    runs: int,
) -> None:
    tensors = sum(1 for _ in specs[0].tensors())
    print(
        f"\nopen time in ms, median of {runs}, {tensors} tensors per model: "
        "warm wall (warm CPU) / wall with the file's pages dropped first"
    )
    print(f"{'model':6} {'size':>8} " + "".join(f"{f:>30}" for f in formats))
    for spec in specs:
        size = paths[spec.label]["edgepack"].stat().st_size / MB
        cells = []
        for f in formats:
            t = results[spec.label, f]
            cold = "n/a" if t.cold is None else f"{t.cold:.2f}"
            cells.append(f"{t.warm:.2f} ({t.warm_cpu:.2f}) / {cold}")
        print(f"{spec.label:6} {size:5.0f} MB " + "".join(f"{c:>30}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
