"""Stored prefix KV caches at run time: used only where bound, bit-identical, tamper-proof;
saved sessions restored only on what they were saved from; stored pages mapped read-only
from the package into the KV pool, shared by sessions, copied (never written) on append."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import convert_to, tiny_model_dir

from edgepack.format import Package, SectionKind
from edgepack.format.errors import CorruptPackageError
from edgepack.format.prefix_cache import PrefixCache, decode_prefix_cache, encode_prefix_cache
from edgepack.packager.prefix_write import rewrite_with_sections
from edgepack.runtime_shim import open
from edgepack.runtime_shim.errors import CorruptSessionError, SessionMismatchError
from edgepack.runtime_shim.instrument import compute_prefix_cache
from edgepack.runtime_shim.page_map import map_file_pages

ENCODING = "int4-g32"
rng = np.random.default_rng(7)
PREFIX = rng.integers(5, 280, 37).tolist()  # 2 full blocks of 16 and a partial one
TAIL = rng.integers(5, 280, 6).tolist()
PROMPT = PREFIX + TAIL


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prefix")
    return convert_to(root, tiny_model_dir(root), ENCODING)


@pytest.fixture(scope="module")
def cache(base: Path) -> PrefixCache:
    with open(base, verify="none") as m:
        return compute_prefix_cache(m, PREFIX)


def _with_cache(src: Path, out: Path, cache: PrefixCache, *, paged: bool = False) -> Path:
    data = encode_prefix_cache(cache, paged=paged)
    section = (SectionKind.PREFIX_KV_CACHE, data, "p0", "application/octet-stream", False)
    return rewrite_with_sections(src, out, [section])


@pytest.fixture(scope="module")
def cached(base: Path, cache: PrefixCache, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_cache(base, tmp_path_factory.mktemp("cached") / "cached.epk", cache)


def _greedy(path: Path, **kw) -> tuple[list[int], int]:
    with open(path, verify="none", **kw) as m:
        s = m.session()
        out = list(s.generate(PROMPT, max_tokens=6))
        return out, s.stats.cached_prompt_tokens


def _scrambled(cache: PrefixCache) -> PrefixCache:
    """The same cache with wrong K/V (each layer's in the other's place; a token order
    alone would not do, attention does not see it): used, it changes the answer."""
    arrays = {k: np.ascontiguousarray(v[::-1]) for k, v in cache.arrays.items()}
    return dataclasses.replace(cache, arrays=arrays)


@pytest.mark.parametrize("block_size", [16, 8])
def test_cached_prefix_is_used_and_next_token_logits_are_bit_identical(
    base: Path, cached: Path, block_size: int
) -> None:
    with open(base, verify="none") as m:
        uncached = m.forward(m.new_sequence(), PROMPT)
        kernels = m.kernel_path
    with open(cached, verify="none", kv_block_size=block_size) as m:
        assert m.kernel_path == kernels
        seq = m.prefix_store.attach(m.new_sequence(), PROMPT, len(PROMPT) - 1)
        assert seq.length == len(PREFIX)
        got = m.forward(seq, TAIL)
    assert np.array_equal(got, uncached)
    ref, hit = _greedy(base)
    assert hit == 0
    assert _greedy(cached) == (ref, len(PREFIX))


def test_a_prompt_that_is_the_prefix_computes_only_its_last_token(
    base: Path, cached: Path
) -> None:
    with open(base, verify="none") as m:
        ref = list(m.session().generate(PREFIX, max_tokens=4))
    with open(cached, verify="none") as m:
        s = m.session()
        assert list(s.generate(PREFIX, max_tokens=4)) == ref
        assert s.stats.cached_prompt_tokens == len(PREFIX) - 1


def test_sessions_share_the_stored_pages_copy_on_write(cached: Path, cache: PrefixCache) -> None:
    from edgepack.runtime_shim.prefix_cache import kv_pages

    with open(cached, verify="none") as m:
        a, b = m.session(), m.session()
        first = list(a.generate(PROMPT, max_tokens=4))
        assert list(b.generate(PREFIX + TAIL[:2], max_tokens=4)) is not None
        assert list(a.generate(PROMPT, max_tokens=4)) == first
        pinned = m.prefix_store._seqs[0]
        for name, stored in kv_pages(pinned).items():  # appending never wrote into them
            assert np.array_equal(stored, cache.arrays[name])
        assert m.kv_pool.stats.cow_copies >= 2


def test_scrambled_pages_with_a_matching_binding_change_the_answer(
    base: Path, cache: PrefixCache, tmp_path: Path
) -> None:
    """The control for the binding tests: a cache that is used does decide the answer."""
    bad = _with_cache(base, tmp_path / "bad.epk", _scrambled(cache))
    assert _greedy(bad)[0] != _greedy(base)[0]


@pytest.mark.parametrize(
    "field",
    ["weights", "adapter", "kv_layout_version", "tokenizer", "chat_template", "rope"],
)
def test_a_cache_bound_to_something_else_is_ignored_with_one_warning(
    field: str, base: Path, cache: PrefixCache, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = getattr(cache.binding, field)
    other = old + 1 if isinstance(old, int) else bytes(b ^ 0x5A for b in old.ljust(32, b"\0"))
    binding = dataclasses.replace(cache.binding, **{field: other})
    wrong = dataclasses.replace(_scrambled(cache), binding=binding)
    bad = _with_cache(base, tmp_path / "b.epk", wrong)
    with caplog.at_level(logging.WARNING, logger="edgepack.runtime"):
        got = _greedy(bad)
    warnings = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert len(warnings) == 1 and f"another {field};" in warnings[0]
    assert got == (_greedy(base)[0], 0)


def test_a_cache_made_on_other_weights_is_ignored(
    base: Path, cache: PrefixCache, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = convert_to(tmp_path, tiny_model_dir(tmp_path), "int8")  # same model, other bytes
    bad = _with_cache(other, tmp_path / "o.epk", cache)
    with caplog.at_level(logging.WARNING, logger="edgepack.runtime"):
        got = _greedy(bad)
    assert any("another weights;" in r.getMessage() for r in caplog.records)
    assert got == (_greedy(other)[0], 0)


def test_a_cache_for_another_kv_layout_is_ignored(
    cached: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="edgepack.runtime"):
        got = _greedy(cached, kv="float")
    assert [r.getMessage() for r in caplog.records if "another kv_layout;" in r.getMessage()]
    assert got[1] == 0


def test_stored_pages_are_aligned_views_of_the_package_mapping(cached: Path) -> None:
    with open(cached, verify="none") as m:
        (_name, stored), = m.prefix_store.caches
        with Package.open(cached) as pkg:
            sec = pkg.sections(SectionKind.PREFIX_KV_CACHE)[0]
        file_start = sec.data.offset  # the payload's place in the file
        payload = m.package.section_view(sec)
        base = np.frombuffer(payload, np.uint8).__array_interface__["data"][0]
        for a in stored.arrays.values():
            assert not a.flags.owndata and not a.flags.writeable  # the read-only mapping
            at = file_start + a.__array_interface__["data"][0] - base
            assert at % 64 == 0


def test_tampered_cache_bytes_fail_verification(cached: Path, tmp_path: Path) -> None:
    with Package.open(cached) as pkg:
        sec = pkg.sections(SectionKind.PREFIX_KV_CACHE)[0]
        pages = decode_prefix_cache(pkg.section_view(sec)).arrays["k"]
        where = sec.data.offset + sec.data.length - pages.nbytes // 2  # inside the K pages
    raw = bytearray(cached.read_bytes())
    raw[where] ^= 1
    bad = tmp_path / "tampered.epk"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CorruptPackageError, match="hash mismatch"):
        open(bad, verify="none")
    with Package.open(bad) as pkg, pytest.raises(CorruptPackageError):
        pkg.verify()


def test_saved_session_restores_to_the_same_continuation(base: Path, tmp_path: Path) -> None:
    with open(base, verify="none") as m:
        s = m.session()
        list(s.generate(PROMPT, max_tokens=3))
        held = s.tokens
        path = s.save(tmp_path / "s.eps")
        expected = list(s.generate(held + TAIL, max_tokens=6))
    for block_size in (16, 8):  # pages are per token: any block size restores them
        with open(base, verify="none", kv_block_size=block_size) as m:
            r = m.restore(path)
            assert r.tokens == held
            assert list(r.generate(held + TAIL, max_tokens=6)) == expected
            assert r.stats.cached_prompt_tokens == len(held)


def test_restore_is_refused_on_other_weights_or_kv_layout(base: Path, tmp_path: Path) -> None:
    with open(base, verify="none") as m:
        s = m.session()
        list(s.generate(PROMPT, max_tokens=2))
        path = s.save(tmp_path / "s.eps")
    other = convert_to(tmp_path, tiny_model_dir(tmp_path), "int8")
    with open(other, verify="none") as m, pytest.raises(SessionMismatchError) as err:
        m.restore(path)
    assert err.value.field == "weights"
    with open(base, verify="none", kv="float") as m, pytest.raises(SessionMismatchError) as err:
        m.restore(path)
    assert err.value.field == "kv_layout"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with open(base, verify="none") as m, pytest.raises(CorruptSessionError, match="hash"):
        m.restore(path)


# -- pages mapped in place (a version 2 payload, what the packager writes) -------------------
_linux = pytest.mark.skipif(
    sys.platform != "linux", reason="/proc/self/maps tells where a page comes from"
)


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


@_linux
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


@_linux
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


@_linux
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


@_linux
def test_appending_never_writes_the_mapping(mapped: Path, cache) -> None:
    """The mapped regions still hold the stored bytes after sessions appended past them
    (the file itself cannot change: its pages are mapped private and read-only)."""
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


@_linux
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


def test_a_version_1_payload_is_copied_into_pool_blocks(cached: Path) -> None:
    plain = cached  # written unpaged
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
