"""Model import for the packager: read a source model as canonical, lazily loaded tensors.

``open_source(path)`` accepts a ``.gguf`` file, a ``.safetensors`` file, or a Hugging Face
model directory (``config.json`` + ``model.safetensors`` or a sharded
``model.safetensors.index.json``) and returns a :class:`SourceModel`. Llama-family models get
the canonical tensor names and config keys documented in :mod:`.names` and :mod:`.config`,
whichever format they came from; unreadable or unsupported sources raise
:class:`~edgepack.packager.errors.ImportModelError`.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ImportModelError
from .source import SourceModel, SourceTensor

__all__ = ["ImportModelError", "SourceModel", "SourceTensor", "open_source"]


def open_source(path: str | Path) -> SourceModel:
    """Open a model by path, dispatching on what it is (GGUF, safetensors, HF directory)."""
    path = Path(path)
    if path.is_dir():
        from .safetensors_source import open_hf_dir

        return open_hf_dir(path)
    if not path.is_file():
        raise ImportModelError(f"{path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        from .gguf_source import open_gguf

        return open_gguf(path)
    if suffix == ".safetensors":
        from .safetensors_source import open_safetensors_file

        return open_safetensors_file(path)
    raise ImportModelError(f"{path.name}: unsupported model file (expected .gguf or .safetensors)")
