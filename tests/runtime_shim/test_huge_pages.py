"""The weights' mapping in 2 MiB pages: probes, the states reported, the bytes unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from pkgfactory import build_package

from edgepack.format import Package
from edgepack.format.reader import QuantizedTensor
from edgepack.runtime_shim import huge_pages
from edgepack.runtime_shim.huge_pages import HUGE_PAGE, map_weights_huge


@pytest.fixture(scope="module")
def big_package(tmp_path_factory):
    """~11 MB: several huge pages of tensor data."""
    path = tmp_path_factory.mktemp("huge") / "big.epk"
    build_package(path, hidden=256, vocab=16384, key=None)
    return path


def _all_bytes(pkg: Package) -> dict[str, bytes]:
    out = {}
    for name in pkg.tensor_names:
        if pkg.entry(name).factors:
            continue
        t = pkg.tensor(name)
        parts = (t.codes, t.scales, t.zeros) if isinstance(t, QuantizedTensor) else (t,)
        out[name] = b"".join(np.ascontiguousarray(a).tobytes() for a in parts if a is not None)
    return out


def test_probes_are_distinct_aligned_pages_inside_tensors(big_package):
    with Package.open(big_package) as pkg:
        probes = huge_pages._probe_views(pkg)
        offsets = [pkg.mapped_offset(v) for v in probes]
    assert len(probes) >= 2
    assert all(off is not None and off % HUGE_PAGE == 0 for off in offsets)
    assert len(set(offsets)) == len(offsets)


def test_not_linux_is_unsupported_and_advises_nothing(big_package, monkeypatch):
    monkeypatch.setattr(huge_pages.sys, "platform", "darwin")
    with Package.open(big_package) as pkg:
        monkeypatch.setattr(pkg, "advise_huge_pages", lambda: pytest.fail("advised"))
        assert map_weights_huge(pkg) == "unsupported"


def test_unaligned_mapping_is_unsupported_and_drops_nothing(big_package, monkeypatch):
    monkeypatch.setattr(huge_pages, "_thp_enabled", lambda: True)
    monkeypatch.setattr(huge_pages, "_address", lambda a: HUGE_PAGE + 4096)
    monkeypatch.setattr(huge_pages.os, "posix_fadvise", lambda *a: pytest.fail("dropped"))
    with Package.open(big_package) as pkg:
        monkeypatch.setattr(pkg, "release_resident_pages", lambda: pytest.fail("released"))
        assert map_weights_huge(pkg) == "unsupported"


def test_small_file_is_unsupported(tmp_path):
    path = tmp_path / "tiny.epk"
    build_package(path, key=None)
    with Package.open(path) as pkg:
        assert map_weights_huge(pkg) == "unsupported"


def test_small_pages_kept_without_evidence_of_huge_file_folios(big_package, monkeypatch):
    monkeypatch.setattr(huge_pages, "_touch_and_count", lambda pkg, probes: False)
    monkeypatch.setattr(huge_pages, "_file_huge_pages_seen", lambda: False)
    monkeypatch.setattr(huge_pages.os, "posix_fadvise", lambda *a: pytest.fail("dropped"))
    with Package.open(big_package) as pkg:
        if huge_pages._address(huge_pages._probe_views(pkg)[0]) % HUGE_PAGE:
            pytest.skip("this mapping is not aligned to huge pages")
        assert map_weights_huge(pkg) == ("small" if huge_pages._thp_enabled() else "unsupported")


@pytest.mark.skipif(not huge_pages._thp_enabled(), reason="transparent huge pages are off")
def test_huge_pages_take_and_the_bytes_stay(big_package, monkeypatch):
    monkeypatch.setattr(huge_pages, "_file_huge_pages_seen", lambda: True)  # try the drop
    with Package.open(big_package) as plain:
        expected = _all_bytes(plain)
    with Package.open(big_package) as pkg:
        state = map_weights_huge(pkg)
        probes = huge_pages._probe_views(pkg)
        address = huge_pages._address(probes[0])
        assert _all_bytes(pkg) == expected
        if state == "small":
            pytest.skip("this file system keeps the file's pages small")
        assert state in ("huge", "refreshed")
        assert huge_pages._pmd_mapped_kib(address) >= len(probes) * (HUGE_PAGE >> 10)
    with Package.open(big_package) as again:
        assert map_weights_huge(again) == "huge"  # the cache keeps the huge folios
