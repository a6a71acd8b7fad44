"""Code pages handed back (runtime_shim.heap): a library's clean pages leave the resident
set when released, and the library runs again after (its pages fault back in)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import TRICKY_TEXTS, smollm2_package

from edgepack.runtime_shim import open as open_model
from edgepack.runtime_shim.heap import release_code_pages, release_library_code

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")


def _read_only_resident_kib(path: str) -> int:
    """Resident KiB of this process's read-only mappings of the file ``path``."""
    total, counting = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                counting = len(fields) > 5 and fields[5] == path and "w" not in fields[1]
            elif counting and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_the_librarys_code_leaves_the_resident_set_and_runs_again(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """release_encoder unmaps the tokenizers extension's clean pages (its code: ~6 MiB
    once a prompt is encoded); encoding again faults them back in and gives the same ids."""
    pytest.importorskip("tokenizers")
    from edgepack.runtime_shim.tokenizer import _library_file

    pkg = smollm2_package(smollm2_gguf, tmp_path_factory.mktemp("smol-code"), "int8")
    library = _library_file()
    with open_model(pkg, verify="none") as model:
        tok = model.tokenizer
        ids = tok.encode(TRICKY_TEXTS[-1])
        before = _read_only_resident_kib(library)
        assert before > 1024
        assert tok.release_encoder()
        assert _read_only_resident_kib(library) < before / 4
        assert tok.encode(TRICKY_TEXTS[-1]) == ids
    assert release_code_pages(str(tmp_path_factory.getbasetemp() / "not-mapped.so")) == 0


def test_every_librarys_code_leaves_and_what_runs_comes_back() -> None:
    """release_library_code: numpy's extension leaves the resident set and computes the
    same after."""
    library = str(Path(np._core._multiarray_umath.__file__).resolve())
    x = np.arange(1000, dtype=np.float32)
    expected = float((x * x).sum())
    before = _read_only_resident_kib(library)
    assert before > 512
    assert release_library_code() > 0
    assert _read_only_resident_kib(library) < before / 2
    assert float((x * x).sum()) == expected


@pytest.mark.parametrize(
    ("path", "library"),
    [
        ("/usr/lib/x86_64-linux-gnu/libc.so.6", True),
        ("/usr/lib/libstdc++.so.6.0.30", True),
        ("/site-packages/numpy/_core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so", True),
        ("/models/a.sorted.epk", False),
        ("/run/x.sock", False),
        ("/tmp/m.so.bak", False),
    ],
)
def test_only_shared_libraries_count_as_library_code(path: str, library: bool) -> None:
    from edgepack.runtime_shim.heap import _SHARED_LIBRARY

    assert (_SHARED_LIBRARY.search(path) is not None) is library
