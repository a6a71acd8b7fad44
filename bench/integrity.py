"""Benchmark: what checking the weights before use costs ``runtime_shim.open``.

On a signed package (the README uses SmolLM2-135M int4-g32, 89 MB), times, as the median
of ``--runs``:

* ``verify_weights`` (SHA-256 of every tensor) on 1 thread and on all CPUs, with a warm
  page cache and with the file's pages dropped first (``POSIX_FADV_DONTNEED``);
* the CPU time of one all-CPU hash (what it costs on a machine shared with other work);
* ``runtime_shim.open`` with ``verify="none"`` (no hashing: the lower bound), the
  default ``"signature"`` (signature + every tensor hashed) and ``"signature"`` with a
  valid integrity record (signature only), warm cache, numpy kernels;
* open + the first token of a short prompt (default kernels), unverified: the work a
  background or on-first-touch check could overlap with (every layer runs for the first
  token, so either must hash every tensor before it anyway).

    python bench/integrity.py PACKAGE --trusted-key NAME.pub [--runs 5]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from edgepack import runtime_shim
from edgepack.format import Package
from edgepack.runtime_shim.integrity import record_verified, verify_weights


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _median_ms(
    fn: Callable[[], object], runs: int, before: Callable[[], None] | None = None
) -> float:
    times = []
    for _ in range(runs):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package")
    ap.add_argument("--trusted-key", required=True)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    path, key, runs = args.package, args.trusted_key, args.runs
    cpus = os.cpu_count() or 1
    with Package.open(path) as pkg:
        nbytes = sum(t.nbytes for t in pkg.header.tensors)
        print(f"{path}: {len(pkg.header.tensors)} tensors, {nbytes / 1e6:.1f} MB; {cpus} CPUs")
        for threads in sorted({1, cpus}):
            warm = _median_ms(lambda t=threads: verify_weights(pkg, t), runs)
            cold = _median_ms(
                lambda t=threads: verify_weights(pkg, t), runs, lambda: _drop_cache(path)
            )
            print(
                f"verify_weights, {threads} thread(s): warm {warm:.1f} ms "
                f"({nbytes / warm / 1e6:.2f} GB/s), cold {cold:.1f} ms"
            )
        cpu0 = time.process_time()
        verify_weights(pkg, cpus)
        print(f"verify_weights CPU time: {(time.process_time() - cpu0) * 1000:.1f} ms")

    def opened(**kw: object) -> None:
        runtime_shim.open(path, kernels="numpy", **kw).close()

    none = _median_ms(lambda: opened(verify="none"), runs)
    hashed = _median_ms(lambda: opened(trusted_keys=[key]), runs)
    with tempfile.TemporaryDirectory() as records:
        record_verified(path, [key], records)
        recorded = _median_ms(
            lambda: opened(trusted_keys=[key], integrity_records=records), runs
        )

    def first_token() -> None:
        with runtime_shim.open(path, verify="none") as model:
            list(model.generate("The capital of France is", max_tokens=1))

    ttft = _median_ms(first_token, runs)
    print(f"open + first token, unverified: {ttft:.1f} ms")
    print(
        f"runtime_shim.open: verify=none {none:.1f} ms, signature {hashed:.1f} ms "
        f"(+{hashed - none:.1f} ms), signature with a record {recorded:.1f} ms"
    )


if __name__ == "__main__":
    main()
