"""The kernel interface the decoder runs on, its numpy implementation and the native adapter.

The model never does arithmetic itself: every op goes through a :class:`Kernels`
object. :class:`NumpyKernels` implements all of them (the reference and the fallback);
:class:`NativeKernels` calls ``edgepack.native._kernels`` for each op that module
provides and numpy for the rest (one warning naming them). ``EDGEPACK_KERNELS`` (or
``open(kernels=...)``) picks ``numpy`` or ``native``; unset, native is used when the
extension loads and provides runtime ops. One INFO line on ``edgepack.runtime`` says
which path is active.

Conventions (all arrays C-contiguous unless noted, float32 unless noted):

* activations ``x: [T, K]`` (T tokens); weights are :class:`~.weights.Linear` ``[R, K]``;
  ``matmul`` returns ``x @ W.T (+ bias) (+ residual)`` as ``[T, R]``;
* dynamic activation quantization, per row and group of ``group`` columns (the
  weight's ``act_group``: its own group for int4, 32 for int8, like llama.cpp's Q8_0;
  ``group == K`` is one scale per token): ``d = absmax / 127``,
  ``q = clip(rint(x * (1/d)), -127, 127)`` (``1/d = 0`` when ``d == 0``), scales float32.
  It *overflows* when ``absmax`` is not finite or ``d > ACT_SCALE_MAX`` (the largest
  float16, so native kernels may keep scales in float16); then the layer is recomputed
  on the float-activation path;
* int8-activation matmul against int4 / int8 weights: int32 dot per (activation group,
  weight group) and one float multiply by both scales; the numpy reference computes the
  same value as ``(q * d) @ dequantize(W).T`` in float32;
* RoPE is Hugging Face's rotate-half on ``[T, heads, head_dim]`` with ``cos, sin:
  [T, head_dim/2]`` tables;
* ``gated_activation(gate, up, act)`` is ``act(gate) * up`` for GELU (erf), tanh-GELU
  and ReLU (SiLU is ``swiglu``); numpy on both backends;
* the KV cache is :mod:`..kv_cache`'s paged layout; ``attend`` writes the new tokens'
  K/V (quantized on write; :class:`~edgepack.runtime_shim.errors.NumericError` if they
  are not finite) and then attends causally (query at position ``p`` sees cache
  positions ``<= p``, and with a sliding ``window`` only those ``> p - window``: a
  mask on positions, the cache keeps every token), dequantizing on read.

A decoder layer is one ``decoder_layer(layer, x, ctx) -> LayerResult`` call. The
sequence is written once in Python (:mod:`.layer`, chaining the ops above) and once in
C++ (the extension's ``decoder_layer``, a whole layer per call, which
:class:`NativeKernels` prefers). A result with ``fallback`` (a :class:`Fallback`, one
enum on both sides of the boundary) makes the model recompute that layer with float
activations (:mod:`..model`). Where the backend has ``decoder_stack`` (native: the
extension's ``Stack``, weights read once) the model runs every layer, the final norm and
the head in one call instead; a layer that asks for a fallback ends that call and the
per-layer path, the reference, goes on from it with the same bits.

One module per job: :mod:`.interface` (protocol and types), :mod:`.layer` (the layer
chain), :mod:`.fallback`, :mod:`.numpy_backend`, :mod:`.native_backend`,
:mod:`.selection`.

Determinism: every output element is produced by one fixed sequence of float ops for a
given shape and thread count (row blocks are statically assigned to threads), so the
same input gives the same bits.
"""

from __future__ import annotations

from .fallback import Fallback
from .interface import (
    ACT_SCALE_MAX,
    KERNEL_OPS,
    Kernels,
    LayerContext,
    LayerResult,
    QuantizedActivations,
    with_float_activations,
)
from .native_backend import NativeKernels
from .numpy_backend import NumpyKernels
from .selection import select_kernels

__all__ = [
    "ACT_SCALE_MAX",
    "KERNEL_OPS",
    "Fallback",
    "Kernels",
    "LayerContext",
    "LayerResult",
    "NativeKernels",
    "NumpyKernels",
    "QuantizedActivations",
    "select_kernels",
    "with_float_activations",
]
