"""The packager's one door into the runtime: observe, override, reference, threads.

The packager measures a model by running it on this runtime: calibration records every
matmul's input, sensitivity swaps weights for quantized ones and compares logits, the
device profiler times single matmuls, the build pins the BLAS thread count. Those needs
are served here, in the runtime's own terms, so nothing else of ``runtime_shim``'s
internals is imported outside it (tests/test_runtime_seam.py walks the packager's
imports). Not imported by ``edgepack.runtime_shim`` itself: apps never load it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np

from edgepack.format import Encoding, Package

from .config import LlamaConfig
from .kernels import NumpyKernels, select_kernels
from .kernels.numpy_backend import set_blas_threads
from .model import Model, open
from .prefix_cache import compute_prefix_cache, prefix_ids
from .weights import Embedding, Linear, bind_weights, quantized_linear

__all__ = [
    "WeightOverrides",
    "check_runnable",
    "compute_prefix_cache",
    "make_linear",
    "observe_matmuls",
    "open_device",
    "open_float_reference",
    "prefix_ids",
    "select_kernels",
    "set_blas_threads",
]

# Observer of one matmul input: (weight name, float32 input [T, K]).
MatmulObserver = Callable[[str, np.ndarray], None]

# runtime LayerWeights attribute of each per-layer tensor kind (spec/FORMAT.md names)
_LAYER_ATTR = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_o": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}
# runtime LayerWeights attribute of each per-layer norm (1-D weights)
_NORM_ATTR = {
    "attn_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "attn_post_norm": "attn_post_norm",
    "ffn_post_norm": "ffn_post_norm",
}
_LAYER_TENSOR = re.compile(r"^layers\.(\d+)\.(\w+)\.(weight|bias)$")
_F32 = np.float32


def check_runnable(path: str | os.PathLike[str]) -> None:
    """Raise what ``open`` would about the package's model config and tensor set (typed:
    corrupt, unsupported, unread tensors), leaving out the runtime-version checks a
    package pinned to a newer runtime is meant to fail."""
    with Package.open(path) as pkg:
        bind_weights(pkg, LlamaConfig.from_dict(pkg.header.identity.config))


def open_float_reference(path: str | os.PathLike[str]) -> Model:
    """A package opened as the packager's float reference: float KV cache, float
    activations, numpy kernels (the bit-exact reference), no signature check."""
    return open(path, kv="float", activations="float", kernels="numpy", verify="none")


def open_device(path: str | os.PathLike[str], kernels: str | None = None) -> Model:
    """A package opened as a device opens it by default (its kernels, KV layout and
    activations; no signature check): what prefix KV caches are computed on."""
    return open(path, kernels=kernels, verify="none")


class _ObservedKernels(NumpyKernels):
    """The numpy backend, showing every matmul input (float) to an observer first."""

    def __init__(self, observer: MatmulObserver, threads: int | None) -> None:
        super().__init__(threads)
        self.name = "numpy+observed"
        self._observer = observer

    def matmul(self, x, w, residual=None):  # type: ignore[override]
        if not isinstance(x, np.ndarray):
            x = x.dequantize()
        self._observer(w.name, x)
        return super().matmul(x, w, residual)


@contextmanager
def observe_matmuls(
    model: Model, observer: MatmulObserver, threads: int | None = None
) -> Iterator[None]:
    """Run ``model`` on numpy kernels that call ``observer(weight_name, x)`` before every
    matmul (low-rank factors too, under their own names); the model's kernels are
    restored on exit. An input shared by several weights (q/k/v, gate/up) is handed to
    each as the very same array object, so an observer can record it once."""
    saved = model.kernels
    observed = _ObservedKernels(observer, threads)
    model.kernels = observed
    try:
        yield
    finally:
        model.kernels = saved
        observed.close()


def make_linear(
    name: str,
    encoding: Encoding,
    shape: tuple[int, ...],
    codes: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    zeros: np.ndarray | None = None,
    group_size: int = 0,
    bias: np.ndarray | None = None,
    factors: tuple[Linear, Linear] | None = None,
) -> Linear:
    """A runtime weight from encoded parts as a package stores them (``[R, ...]``
    flattened to ``[R, C]``), or from low-rank ``factors`` (U, V)."""
    rows = int(shape[0])
    cols = math.prod(shape[1:])
    if factors is not None:
        return Linear(name, Encoding.LOW_RANK, rows, cols, bias=bias, factors=factors)
    if codes is None:
        raise ValueError(f"make_linear({name!r}): codes or factors are needed")
    if encoding.is_float:
        return Linear(name, encoding, rows, cols, codes=codes.reshape(rows, -1), bias=bias)
    return quantized_linear(
        name, encoding, rows, cols, codes, scales, zeros, group_size, bias=bias
    )


class WeightOverrides:
    """Swap a model's weights (by tensor name) and put the originals back.

    An override is not bound natively: on the native backend it runs on numpy kernels
    (and its layer on the shared Python chain); the float reference is all numpy anyway.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        w = model.weights
        keep = (*_LAYER_ATTR.values(), *_NORM_ATTR.values())
        self._orig: dict[str, Any] = {
            "embed": w.embed,
            "output": w.output,
            "norm": w.norm,
            "layers": [{a: getattr(lw, a) for a in keep} for lw in w.layers],
        }

    def reset(self) -> None:
        w = self.model.weights
        w.embed, w.output, w.norm = self._orig["embed"], self._orig["output"], self._orig["norm"]
        for lw, orig in zip(w.layers, self._orig["layers"], strict=True):
            for a, lin in orig.items():
                setattr(lw, a, lin)

    def bias_of(self, name: str) -> np.ndarray | None:
        """The current bias of per-layer weight ``name`` (None for other tensors)."""
        m = _LAYER_TENSOR.fullmatch(name)
        if m is None or m[2] not in _LAYER_ATTR:
            return None
        return getattr(self.model.weights.layers[int(m[1])], _LAYER_ATTR[m[2]]).bias

    def set_vector(self, name: str, values: np.ndarray) -> None:
        """A 1-D tensor: ``norm.weight``, a layer's norm weight or a layer weight's bias."""
        w = self.model.weights
        v = np.ascontiguousarray(values, _F32)
        m = _LAYER_TENSOR.fullmatch(name)
        if name == "norm.weight":
            w.norm = v
        elif m and m[3] == "weight" and m[2] in _NORM_ATTR:
            setattr(w.layers[int(m[1])], _NORM_ATTR[m[2]], v)
        elif m and m[3] == "bias" and m[2] in _LAYER_ATTR:
            lw = w.layers[int(m[1])]
            old = getattr(lw, _LAYER_ATTR[m[2]])
            setattr(lw, _LAYER_ATTR[m[2]], replace(old, bias=v, native=None))

    def set_linear(self, name: str, lin: Linear, role: str | None = None) -> None:
        """Use ``lin`` for matrix ``name``; ``role`` ("embed"/"head") picks one use of a
        tied embedding (default: both)."""
        w = self.model.weights
        m = _LAYER_TENSOR.fullmatch(name)
        if m is not None and m[2] in _LAYER_ATTR:
            setattr(w.layers[int(m[1])], _LAYER_ATTR[m[2]], lin)
            return
        if w.embed.table.name == name and role in (None, "embed"):
            w.embed = Embedding(lin)
        if w.output.name == name and role in (None, "head"):
            w.output = lin
