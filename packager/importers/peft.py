"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT names each factor after the module it wraps
(``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``: A ``[r, in]``,
``lora_B`` ``[out, r]``); the module's weight name maps to the package's canonical one
(:func:`~.names.canonical_from_hf`). The scale is ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern`` / ``alpha_pattern`` override
both per module. Dropout only matters in training and is ignored. What would change the
math beyond ``W + s * B A`` (DoRA, trained biases, fully trained modules, embedding
adapters) is refused rather than silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ImportModelError
from .names import canonical_from_hf

__all__ = ["FloatAdapter", "FloatTarget", "is_peft_dir", "read_peft"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


@dataclass
class FloatTarget:
    """One adapted matrix in float32: ``W + scale * b @ a``."""

    a: np.ndarray  # [r, in]
    b: np.ndarray  # [out, r]
    scale: float


@dataclass
class FloatAdapter:
    """An imported adapter before encoding: targets keyed by canonical tensor name."""

    name: str
    rank: int
    alpha: float
    source: str
    targets: dict[str, FloatTarget] = field(default_factory=dict)


def is_peft_dir(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_peft(path: Path, family: str = "llama") -> FloatAdapter:
    """The adapter in the PEFT folder ``path``; ImportModelError when it is not one this
    runtime can apply exactly."""
    cfg = _config(path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise ImportModelError(f"{path}: no {WEIGHTS_FILE} (PEFT's .bin format is not read)")
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ImportModelError(f"{weights}: not a readable safetensors file: {exc}") from None
    rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ImportModelError(f"{weights}: {key!r} is not a LoRA factor (only LoRA applies)")
        pairs.setdefault(match["module"], {})[match["ab"]] = value
    out = FloatAdapter(path.name, rank, alpha, "peft")
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ImportModelError(f"{weights}: {module} has lora_{''.join(ab)} only")
        a, b = (np.asarray(ab[k], np.float32) for k in "AB")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ImportModelError(f"{weights}: {module}: A {a.shape} and B {b.shape} do not pair")
        if cfg.get("fan_in_fan_out"):
            raise ImportModelError(f"{path}: fan_in_fan_out (Conv1D models) is not supported")
        r = _pattern(rank_pattern, module, rank)
        if r != a.shape[0]:
            raise ImportModelError(f"{weights}: {module} has rank {a.shape[0]}, config says {r}")
        s = _pattern(alpha_pattern, module, alpha)
        scale = s / math.sqrt(r) if cfg.get("use_rslora") else s / r
        name = canonical_from_hf(module + ".weight", family)
        out.targets[name] = FloatTarget(a, b, scale)
    if not out.targets:
        raise ImportModelError(f"{weights}: holds no LoRA factors")
    return out


def _config(path: Path) -> dict:
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ImportModelError(f"{path / CONFIG_FILE}: unreadable: {exc}") from None
    if not isinstance(cfg, dict):
        raise ImportModelError(f"{path / CONFIG_FILE}: not a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise ImportModelError(f"{path}: PEFT type {kind} (only LORA adapters are supported)")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise ImportModelError(f"{path / CONFIG_FILE}: {key} must be a positive number")
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (fully trained modules)",
        "lora_bias": "lora_bias (trained biases of B)",
        "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
        "layer_replication": "layer_replication",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise ImportModelError(f"{path}: {what} is not supported: merge it with PEFT first")
    if cfg.get("bias", "none") != "none":
        raise ImportModelError(f"{path}: trained biases (bias={cfg['bias']!r}) are not supported")
    return cfg


def _pattern(pattern: dict, module: str, default: float):
    """PEFT's per-module override: a key matching the end of the module's name."""
    for key, value in pattern.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default
