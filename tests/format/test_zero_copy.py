"""Tensors are read-only views of the file mapping, and opening does not read the data.

Evidence is taken from the kernel, not from the reader's own attributes: the view's
data pointer must lie in the file's mapping listed in ``/proc/self/maps``; opening a
~512 MB package must not raise the process RSS by 50 MB, must leave the mapping's
resident set (``/proc/self/smaps``) empty and must read only a few KB
(``/proc/self/io`` rchar). Touching a tensor afterwards does raise the mapping's
resident set, which shows the measurement itself works.
"""

from __future__ import annotations

import gc
import mmap
import os
import resource
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from pkgfactory import BuiltPackage, build_package

from edgepack.format import (
    Encoding,
    ModelIdentity,
    Package,
    PackageWriter,
    QuantizedTensor,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="uses /proc/self/{maps,smaps,io}"
)

MB = 1 << 20
BIG_TENSORS = 16
BIG_TENSOR_BYTES = 32 * MB  # 16 x 32 MiB of f16 = 512 MiB


def mappings(path: Path) -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of every mapping of ``path`` in this process."""
    target = str(path.resolve())
    found: list[tuple[int, int, int]] = []
    current: list[int] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                if current:
                    found.append((current[0], current[1], current[2]))
                current = None
                if len(head) >= 6 and " ".join(head[5:]) == target:
                    start, end = (int(x, 16) for x in head[0].split("-"))
                    current = [start, end, 0]
            elif current is not None and head[0] == "Rss:":
                current[2] = int(head[1]) * 1024
    if current:
        found.append((current[0], current[1], current[2]))
    return found


def bytes_read() -> int:
    """Bytes this process has read through read()-like syscalls so far (rchar)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def page_faults() -> int:
    """Page faults this process has taken so far: touching mapped file pages counts here."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def root_buffer(array: np.ndarray) -> object:
    base: object = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def stored_views(pkg: Package, name: str) -> list[np.ndarray]:
    stored = pkg.tensor(name)
    if isinstance(stored, QuantizedTensor):
        return [a for a in (stored.codes, stored.scales, stored.zeros) if a is not None]
    return [stored]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> BuiltPackage:
    return build_package(tmp_path_factory.mktemp("zc") / "small.epk")


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~512 MiB package of f16 tensors, built one tensor at a time (low memory)."""
    path = tmp_path_factory.mktemp("zc-big") / "big.epk"
    rows = 4096
    cols = BIG_TENSOR_BYTES // 2 // rows
    block = np.random.default_rng(0).standard_normal((rows, cols // 8)).astype(np.float16)
    with PackageWriter(path, ModelIdentity("big", "1.0.0", "llama")) as w:
        for i in range(BIG_TENSORS):
            w.add_tensor(f"blk.{i}.ffn_up.weight", Encoding.F16, np.tile(block + i, (1, 8)))
        w.add_tensor("output_norm.weight", Encoding.F32, np.ones(cols, np.float32))
    _drop_page_cache(path)
    return path


def _drop_page_cache(path: Path) -> None:
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --------------------------------------------------------------------- views


def test_views_point_into_the_file_mapping(small: BuiltPackage) -> None:
    with Package.open(small.path) as pkg:
        (start, end, _), *rest = mappings(small.path)
        assert not rest, "the package is mapped exactly once"
        checked = 0
        for entry in pkg.header.tensors:
            if entry.encoding == Encoding.LOW_RANK:
                continue
            spans = [s for s in entry.spans if s.length]
            for view, span, expected in zip(
                stored_views(pkg, entry.name), spans, small.stored[entry.name], strict=True
            ):
                pointer = view.__array_interface__["data"][0]
                assert start <= pointer and pointer + view.nbytes <= end
                assert pointer - start == span.offset  # exactly where the header says
                assert not view.flags.writeable and not view.flags.owndata
                mapping = root_buffer(view)
                assert isinstance(mapping, mmap.mmap)
                assert np.shares_memory(view, np.frombuffer(mapping, np.uint8))
                np.testing.assert_array_equal(view.reshape(expected.shape), expected)
                checked += 1
        assert checked == sum(len(parts) for parts in small.stored.values())


def test_views_are_read_only(small: BuiltPackage) -> None:
    with Package.open(small.path) as pkg:
        view = pkg.tensor("token_embd.weight")
        with pytest.raises(ValueError, match="read-only"):
            view[0, 0] = 1
        with pytest.raises(ValueError):
            view.setflags(write=True)  # the mapping is PROT_READ: numpy refuses
        q = pkg.tensor("blk.0.attn_q.weight")
        assert isinstance(q, QuantizedTensor)
        with pytest.raises(ValueError, match="read-only"):
            q.codes[0, 0] = 0


def test_dequantize_copies_and_leaves_the_file_alone(small: BuiltPackage) -> None:
    with Package.open(small.path) as pkg:
        values = pkg.dequantize("blk.0.attn_v.weight")
        assert values.flags.writeable and not isinstance(root_buffer(values), mmap.mmap)
        values[...] = 0  # a private copy: writable, and the package is unchanged
        pkg.verify(trusted_keys=[small.public_key])


# --------------------------------------------------------------------- lifetime


def test_close_with_live_views_keeps_them_valid(small: BuiltPackage) -> None:
    pkg = Package.open(small.path)
    embd = pkg.tensor("token_embd.weight")
    quant = pkg.tensor("blk.1.ffn_down.weight")
    assert isinstance(quant, QuantizedTensor)
    expected_codes = small.stored["blk.1.ffn_down.weight"][0]
    pkg.close()  # must not raise although views are alive
    pkg.close()  # idempotent
    gc.collect()
    np.testing.assert_array_equal(embd, small.stored["token_embd.weight"][0])
    np.testing.assert_array_equal(quant.codes, expected_codes)
    assert float(np.abs(embd.astype(np.float32)).sum()) > 0  # touch every page
    assert mappings(small.path), "the mapping lives as long as a view does"
    with pytest.raises(ValueError, match="closed"):
        pkg.tensor("token_embd.weight")
    del embd, quant
    gc.collect()
    assert not mappings(small.path), "the last view released the mapping"


def test_views_survive_an_atomic_update_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.epk"
    first = build_package(path, seed=1)
    with Package.open(path) as pkg:
        view = pkg.tensor("token_embd.weight")
        build_package(path, seed=2)  # the writer renames a new file over the old path
        np.testing.assert_array_equal(view, first.stored["token_embd.weight"][0])
        del view


def test_released_pages_leave_the_resident_set_and_read_back_the_same(small: BuiltPackage) -> None:
    """After a hash pass the whole file is resident; releasing drops it from this
    process (not from the file): the views read the same bytes again."""
    with Package.open(small.path) as pkg:
        pkg.verify(trusted_keys=[small.public_key])
        ((_, _, resident),) = mappings(small.path)
        assert resident > 0
        pkg.release_resident_pages()
        ((_, _, released),) = mappings(small.path)
        assert released == 0
        np.testing.assert_array_equal(
            pkg.tensor("token_embd.weight"), small.stored["token_embd.weight"][0]
        )
        assert mappings(small.path)[0][2] > 0  # read back in
        pkg.verify(trusted_keys=[small.public_key])


# --------------------------------------------------------------------- cost of opening


@pytest.mark.slow
def test_opening_512mb_does_not_read_or_map_in_the_data(big: Path) -> None:
    size = big.stat().st_size
    assert size > 500 * MB
    process = psutil.Process()
    gc.collect()
    rss_before, read_before = process.memory_info().rss, bytes_read()
    faults_before = page_faults()
    pkg = Package.open(big)
    try:
        faults = page_faults() - faults_before
        rss_growth = process.memory_info().rss - rss_before
        read = bytes_read() - read_before
        ((_, _, resident),) = mappings(big)
        assert rss_growth < 50 * MB, f"opening raised RSS by {rss_growth / MB:.1f} MB"
        assert read < 64 * 1024, f"opening read {read} bytes of a {size}-byte file"
        assert resident < 64 * 1024, f"{resident} bytes of the mapping are resident"
        # the measurement is live: touching one tensor makes its pages resident
        name = pkg.tensor_names[3]
        faults_before = page_faults()
        assert float(np.asarray(pkg.tensor(name), np.float32).sum()) != 0.0
        touch_faults = page_faults() - faults_before
        ((_, _, resident_after),) = mappings(big)
        assert resident_after >= 0.9 * pkg.entry(name).nbytes
    finally:
        pkg.close()
    # Page faults catch what rchar and the resident set miss: data read through a mapping
    # made and dropped inside open(). Hashing the 16 tensors would fault ~16x what reading
    # one does. So opening is O(header); bench/open.py times it.
    assert faults < touch_faults, f"opening took {faults} page faults, one tensor {touch_faults}"
    print(f"\nopen 512 MB: RSS +{rss_growth / MB:.1f} MB, read {read} B, {faults} page faults")
