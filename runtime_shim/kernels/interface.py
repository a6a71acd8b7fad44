"""What every backend implements and passes around: the ``Kernels`` protocol, the
activation and layer-call types, and the numeric limits both backends share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from ..kv_cache import LayerKV
from ..weights import LayerWeights, Linear
from .fallback import Fallback

if TYPE_CHECKING:
    from ..adapters import LayerLora

__all__ = [
    "ACT_SCALE_MAX",
    "INJECT_FACTOR",
    "KERNEL_OPS",
    "Kernels",
    "LayerContext",
    "LayerResult",
    "QuantizedActivations",
    "StackResult",
    "with_float_activations",
]

ACT_SCALE_MAX = 65504.0
# The injected-overflow hook multiplies a layer's first quantized activation by this.
INJECT_FACTOR = np.float32(1e36)
_F32 = np.float32

# Ops a backend provides (the Protocol below); native may provide any subset.
KERNEL_OPS = (
    "rmsnorm",
    "rmsnorm_quantize",
    "quantize_activations",
    "matmul",
    "swiglu",
    "swiglu_quantize",
    "rope",
    "attend",
)


class QuantizedActivations(NamedTuple):
    q: np.ndarray  # int8 [T, K]
    scales: np.ndarray  # float32 [T, K // group]
    group: int
    overflow: bool

    def dequantize(self) -> np.ndarray:
        t, k = self.q.shape
        x = self.q.reshape(t, k // self.group, self.group).astype(_F32)
        x *= self.scales[:, :, None]
        return x.reshape(t, k)


@dataclass(frozen=True)
class LayerContext:
    """Everything one decoder layer call needs besides weights and input."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    cos: np.ndarray  # [T, head_dim/2], row t for positions[t]
    sin: np.ndarray
    positions: np.ndarray  # int64 [T], consecutive: start .. start+T-1
    block_table: np.ndarray  # int32 [ceil(n_ctx / block_size)] of the sequence
    n_ctx: int  # cache positions valid after this call's writes (= positions[-1] + 1)
    kv: LayerKV
    act_int8: bool  # int8-activation path (else float activations)
    inject_overflow: bool = False
    activation: str = "silu"  # act of the FFN's act(gate) * up (see config_table.ACTIVATIONS)
    window: int | None = None  # sliding window: query at p sees keys at p - window < pos <= p
    attn_scale: float | None = None  # scores scale (None: 1/sqrt(head_dim))
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask
    lora: LayerLora | None = None  # the session's adapter on this layer (runtime_shim/adapters)
    arena: Any = None  # the native layer's planned buffer (runtime_shim.layer_arena), or None

    @property
    def windowed(self) -> bool:
        """True when the window hides some key from some query of this call."""
        return self.window is not None and self.n_ctx > self.window

    @property
    def start(self) -> int:
        return int(self.positions[0])


class LayerResult(NamedTuple):
    x: np.ndarray | None  # the layer's output (residual stream), None when it gave up
    fallback: Fallback | None  # why the float path must recompute this layer, or None


class StackResult(NamedTuple):
    """What a one-call forward (``decoder_stack``) did: ``done`` layers ran; when that is
    all of them ``x`` is the final-normed hidden state and ``logits`` the head's output
    of its last row (None: the caller's head runs); else ``x`` is layer ``done``'s input
    and the caller's per-layer chain takes over from there."""

    x: np.ndarray
    done: int
    logits: np.ndarray | None


@runtime_checkable
class Kernels(Protocol):
    """What a backend implements (see the module docstring for the numerics).

    Quantizing ops report an overflow through ``QuantizedActivations.overflow``; ``attend``
    raises :class:`~edgepack.runtime_shim.errors.NumericError` when K/V to be quantized
    are not finite.
    """

    name: str
    threads: int

    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray: ...

    def quantize_activations(self, x: np.ndarray, group: int) -> QuantizedActivations: ...

    def rmsnorm_quantize(
        self, x: np.ndarray, weight: np.ndarray, eps: float, group: int
    ) -> QuantizedActivations: ...

    def matmul(
        self,
        x: np.ndarray | QuantizedActivations,
        w: Linear,
        residual: np.ndarray | None = None,
    ) -> np.ndarray: ...

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray: ...

    def swiglu_quantize(
        self, gate: np.ndarray, up: np.ndarray, group: int
    ) -> QuantizedActivations: ...

    def gated_activation(self, gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray: ...

    def rope(
        self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray
    ) -> np.ndarray: ...

    def attend(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        kv: LayerKV,
        block_table: np.ndarray,
        start: int,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> np.ndarray: ...

    def decoder_layer(self, lw: LayerWeights, x: np.ndarray, ctx: LayerContext) -> LayerResult: ...

    def bind(self, weights: Sequence[Linear]) -> None: ...

    def close(self) -> None: ...



def with_float_activations(ctx: LayerContext) -> LayerContext:
    return replace(ctx, act_int8=False, inject_overflow=False)
