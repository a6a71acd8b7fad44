"""The importers' data model: a source model seen as named, lazily loaded tensors.

Every importer (safetensors, GGUF) produces the same :class:`SourceModel`, so the
packager never needs to know where the weights came from. Tensors are loaded one at a
time through :meth:`SourceTensor.load`, which keeps peak memory at one tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SourceModel", "SourceTensor", "sha256_of_files"]

_CHUNK = 1 << 20


@dataclass
class SourceTensor:
    """One tensor of a source model, under its canonical name, not yet read."""

    name: str
    shape: tuple[int, ...]
    source_dtype: str
    loader: Callable[[], np.ndarray] = field(repr=False, compare=False)

    def load(self) -> np.ndarray:
        """Read, dequantize and relayout this tensor: float32, C-contiguous, a fresh array."""
        array = self.loader()
        if array.shape != self.shape:
            raise AssertionError(f"{self.name}: loader gave {array.shape}, expected {self.shape}")
        return array


@dataclass
class SourceModel:
    """A model as the packager sees it, whatever file format it came from."""

    name: str
    architecture: str
    config: dict[str, Any]
    tensors: list[SourceTensor]
    tokenizer_json: str | None
    chat_template: str | None
    source_files: list[Path]
    source_sha256: str

    def tensor(self, name: str) -> SourceTensor:
        """Look a tensor up by canonical name (KeyError when absent: a caller's mistake)."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_of_files(paths: Iterable[Path]) -> str:
    """Identify a source by content, streamed so that multi-GB shards stay out of memory.

    A single file hashes to its plain sha256 (what ``sha256sum`` prints). Several files hash
    to the sha256 of their ``sha256sum``-style manifest (``<hex>  <name>\\n`` per file,
    sorted by name), so renaming the folder does not change the identity.
    """
    files = sorted(paths, key=lambda p: p.name)
    if len(files) == 1:
        return _file_sha256(files[0])
    manifest = "".join(f"{_file_sha256(p)}  {p.name}\n" for p in files)
    return hashlib.sha256(manifest.encode()).hexdigest()
