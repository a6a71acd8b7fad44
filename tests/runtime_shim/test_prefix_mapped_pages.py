"""Stored prefix pages used in place: mapped read-only from the package into the KV pool,
shared by sessions, copied (never written) when a session appends into them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import convert_to, tiny_model_dir

from edgepack.format import SectionKind
from edgepack.format.prefix_cache import PrefixCache, encode_prefix_cache
from edgepack.packager.prefix_write import rewrite_with_sections
from edgepack.runtime_shim import open
from edgepack.runtime_shim.instrument import compute_prefix_cache
from edgepack.runtime_shim.page_map import map_file_pages

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="/proc/self/maps tells where a page comes from"
)

rng = np.random.default_rng(11)
PREFIX = rng.integers(5, 280, 37).tolist()  # 2 full blocks of 16 and a partial one
TAIL = rng.integers(5, 280, 6).tolist()
PROMPT = PREFIX + TAIL


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mapped")
    return convert_to(root, tiny_model_dir(root), "int4-g32")


@pytest.fixture(scope="module")
def cache(base: Path) -> PrefixCache:
    with open(base, verify="none") as m:
        return compute_prefix_cache(m, PREFIX)


def _with_cache(src: Path, out: Path, cache: PrefixCache, *, paged: bool) -> Path:
    data = encode_prefix_cache(cache, paged=paged)
    section = (SectionKind.PREFIX_KV_CACHE, data, "p0", "application/octet-stream", False)
    return rewrite_with_sections(src, out, [section])


@pytest.fixture(scope="module")
def mapped(base: Path, cache: PrefixCache, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mapped-pkg") / "paged.epk"
    return _with_cache(base, out, cache, paged=True)


def _maps() -> list[tuple[int, int, str, int, str]]:
    """(start, end, perms, file offset, path) of every mapping of this process."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append((lo, hi, parts[1], int(parts[2], 16), parts[5] if len(parts) > 5 else ""))
    return out


def _mapping_of(address: int) -> tuple[int, int, str, int, str]:
    (hit,) = [m for m in _maps() if m[0] <= address < m[1]]
    return hit


def _block_address(pool, name: str, layer: int, block: int) -> int:
    return getattr(pool.layer(layer), name)[block].__array_interface__["data"][0]


def test_stored_pages_are_the_package_file_mapped_read_only(mapped: Path, cache) -> None:
    with open(mapped, verify="none") as m:
        store, pool = m.prefix_store, m.kv_pool
        assert store.mapped == {0}
        pinned = store._seqs[0]
        assert all(pool.is_mapped(b) for b in pinned.blocks)
        for name in cache.arrays:
            for layer in range(pool.num_layers):
                for b in pinned.blocks:
                    _lo, _hi, perms, _off, path = _mapping_of(_block_address(pool, name, layer, b))
                    assert Path(path) == mapped.resolve() and perms.startswith("r-")
                    assert "w" not in perms
                slots = pool.mapped_region(name, layer, pinned.blocks[0], len(PREFIX))
                assert np.array_equal(slots, cache.arrays[name][layer])  # the same bytes


def test_two_sessions_attach_the_same_mapped_blocks(mapped: Path) -> None:
    with open(mapped, verify="none") as m:
        a, b = m.session(), m.session()
        list(a.generate(PROMPT, max_tokens=2))
        list(b.generate(PREFIX + TAIL[:3], max_tokens=2))
        full = len(PREFIX) // m.kv_pool.block_size
        pinned = m.prefix_store._seqs[0].blocks
        assert a.seq.blocks[:full] == b.seq.blocks[:full] == pinned[:full]
        # the partly filled last block was copied by each session before appending
        assert a.seq.blocks[full] != pinned[full] != b.seq.blocks[full]
        assert not m.kv_pool.is_mapped(a.seq.blocks[full])
        assert m.kv_pool.stats.cow_copies >= 2


def test_mapped_prefix_gives_bit_identical_logits_and_the_same_answer(
    base: Path, mapped: Path
) -> None:
    with open(base, verify="none") as m:
        uncached = m.forward(m.new_sequence(), PROMPT)
        ref = list(m.session().generate(PROMPT, max_tokens=6))
    for block_size in (16, 8):
        with open(mapped, verify="none", kv_block_size=block_size) as m:
            assert m.prefix_store.mapped == {0}
            seq = m.prefix_store.attach(m.new_sequence(), PROMPT, len(PROMPT) - 1)
            assert seq.length == len(PREFIX)
            assert np.array_equal(m.forward(seq, TAIL), uncached)
            s = m.session()
            assert list(s.generate(PROMPT, max_tokens=6)) == ref
            assert s.stats.cached_prompt_tokens == len(PREFIX)


def test_appending_never_writes_the_mapping(mapped: Path, cache) -> None:
    before = mapped.read_bytes()
    with open(mapped, verify="none") as m:
        pool = m.kv_pool
        sessions = [m.session() for _ in range(3)]
        for i, s in enumerate(sessions):
            list(s.generate(PREFIX + TAIL[: i + 1], max_tokens=5))
        pinned = m.prefix_store._seqs[0]
        for name, stored in cache.arrays.items():
            for layer in range(pool.num_layers):
                got = pool.mapped_region(name, layer, pinned.blocks[0], len(PREFIX))
                assert np.array_equal(got, stored[layer])
    assert mapped.read_bytes() == before


def test_a_write_into_the_mapped_pages_faults(mapped: Path) -> None:
    """The mapping is read-only: a stray write kills the process, it cannot change what
    other sessions read."""
    code = textwrap.dedent(
        f"""
        from edgepack.runtime_shim import open
        m = open({str(mapped)!r}, verify="none")
        b = m.prefix_store._seqs[0].blocks[0]
        print("mapped", m.kv_pool.is_mapped(b), flush=True)
        m.kv_pool.layer(0).k[b, 0, 0, 0] = 1
        print("written", flush=True)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "mapped True" in r.stdout and "written" not in r.stdout
    assert r.returncode < 0, r.stderr  # killed by a signal (SIGSEGV)


def test_a_version_1_payload_is_copied_into_pool_blocks(
    base: Path, cache: PrefixCache, tmp_path: Path
) -> None:
    plain = _with_cache(base, tmp_path / "v1.epk", cache, paged=False)
    with open(plain, verify="none") as m:
        assert m.prefix_store.mapped == set()
        s = m.session()
        list(s.generate(PROMPT, max_tokens=2))
        assert s.stats.cached_prompt_tokens == len(PREFIX)
        assert not any(m.kv_pool.is_mapped(b) for b in s.seq.blocks)


def test_map_file_pages_refuses_unaligned_requests(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"\0" * 8192)
    with f.open("rb") as fh:
        assert not map_file_pages(4097, 4096, fh.fileno(), 0)
        assert not map_file_pages(4096 * 16, 4096, fh.fileno(), 100)
