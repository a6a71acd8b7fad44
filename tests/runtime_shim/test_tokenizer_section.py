"""The runtime reads its tokenizer section hash-checked but unparsed by the reader (the
tokenizer's own parse is the check): a section that does not parse as a tokenizer is
still a typed CorruptPackageError (exit 3), on either backend."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgepack.cli.exit_codes import EXIT_CORRUPT, exit_code_for
from edgepack.format import Encoding, ModelIdentity, Package, PackageWriter, SectionKind
from edgepack.format.errors import CorruptPackageError
from edgepack.runtime_shim import Tokenizer, TokenizerUnavailableError


def _package(tmp_path: Path, tokenizer: bytes | None) -> Path:
    path = tmp_path / "t.epk"
    with PackageWriter(path, ModelIdentity("m", "1.0.0", "llama")) as w:
        w.add_tensor("w", Encoding.F32, np.ones(4, np.float32))
        if tokenizer is not None:
            w.add_section(SectionKind.TOKENIZER, tokenizer)
    return path


@pytest.mark.parametrize("backend", ["tokenizers", "python"])
def test_a_bpe_without_its_vocabulary_is_corrupt(tmp_path: Path, backend: str) -> None:
    if backend == "tokenizers":
        pytest.importorskip("tokenizers")
    path = _package(tmp_path, json.dumps({"model": {"type": "BPE"}}).encode())
    with Package.open(path) as pkg:
        with pytest.raises(CorruptPackageError, match="tokenizer section does not parse") as err:
            Tokenizer.from_package(pkg, backend)
    assert exit_code_for(err.value) == EXIT_CORRUPT


def test_a_bad_backend_choice_stays_the_callers_error(tmp_path: Path) -> None:
    with Package.open(_package(tmp_path, b"{}")) as pkg:
        with pytest.raises(ValueError, match="backend must be"):
            Tokenizer.from_package(pkg, "sentencepiece")


def test_no_tokenizer_section_is_unavailable(tmp_path: Path) -> None:
    with Package.open(_package(tmp_path, None)) as pkg:
        with pytest.raises(TokenizerUnavailableError):
            Tokenizer.from_package(pkg)
