"""LoRA adapters applied online, per session, on one mapped base.

``Model.load_adapter`` decodes a LORA_ADAPTER section (from the model's own package or
an adapter-only one), refuses it unless it was made for these weights and every target
is a matrix the decoder applies (:func:`edgepack.format.adapter.check_binding`), and
keeps its factors as stored (``A [r, in]``, ``B [out, r]``, int8 per row by default): the
native layer multiplies them in that encoding, so a decode step reads a quarter of the
bytes float factors would take. The base is never read or copied for it. A session
picks one adapter (or none) and a scale; the layer chain adds ``s * (x A^T) B^T`` to
each adapted projection (:mod:`.kernels.layer`), on the float and the int8-activation
path alike (the int8 path's adapter input is the same quantized activation the base
matmul reads).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from edgepack.format.adapter import (
    LoraAdapter,
    LoraFactor,
    LoraTarget,
    adapter_digest,
    check_binding,
    decode_adapter,
)
from edgepack.format.encodings import Encoding
from edgepack.format.errors import AdapterTargetError

from .kernels.interface import QuantizedActivations

__all__ = ["ActiveAdapter", "AdapterHandle", "LayerLora", "LoraPair", "load_payload"]

_F32 = np.float32
# canonical tensor suffix -> the LayerWeights slot the layer chain applies it to
SLOTS = {
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_o.weight": "o",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}


@dataclass(frozen=True, eq=False)
class LoraPair:
    """One adapted projection: ``delta(x) = ((x @ A^T) * (s * scale)) @ B^T``.

    The factors keep their stored encoding: ``a`` as stored, B transposed (``b_t``, int8
    codes with B's per-row ``b_scales``, or float32) so the native up-projection runs
    along contiguous output rows, vectorized with no sum across lanes.
    """

    a: LoraFactor  # [r, in]
    b_t: np.ndarray  # [r, out]: int8 codes (with b_scales [out]) or float32 values
    b_scales: np.ndarray | None
    scale: float  # the target's (alpha / r, or alpha / sqrt(r) for rsLoRA)

    def delta(self, x: np.ndarray | QuantizedActivations, scale: float) -> np.ndarray:
        xf = x.dequantize() if isinstance(x, QuantizedActivations) else x
        h = xf @ self.a.values().T  # dequantized per call: only the numpy chain needs floats
        h *= _F32(scale * self.scale)
        b_t = self.b_t if self.b_scales is None else self.b_t.astype(_F32) * self.b_scales
        return h @ b_t

    @property
    def nbytes(self) -> int:
        scales = 0 if self.b_scales is None else self.b_scales.nbytes
        return self.a.nbytes + self.b_t.nbytes + scales


def _owned(t: LoraTarget) -> tuple[LoraPair, LoraTarget]:
    """The pair for ``t``, and ``t`` on the pair's own copies of the factors: the decoded
    payload, which every factor of ``t`` views, is not kept alive beside them (and a
    float16 B is not kept beside its float32 B^T: ``t``'s B becomes that, as float32)."""
    a = dataclasses.replace(t.a, codes=t.a.codes.copy())
    if a.scales is not None:
        a = dataclasses.replace(a, scales=a.scales.copy())
    b = t.b
    if b.scales is not None:  # int8: B^T codes, B's per-row scales one per output
        b_t, b_scales = np.ascontiguousarray(b.codes.T), b.scales.copy()
        b = dataclasses.replace(b, codes=b_t.T, scales=b_scales)
    else:  # float16 or float32: held once, as the float32 B^T the native layer reads
        b_t, b_scales = np.ascontiguousarray(b.values().T), None
        b = LoraFactor(Encoding.F32, b.shape, b_t.T)
    return LoraPair(a, b_t, b_scales, float(t.scale)), dataclasses.replace(t, a=a, b=b)


@dataclass(frozen=True, eq=False)
class LayerLora:
    """The adapted projections of one layer under one session's scale."""

    pairs: Mapping[str, LoraPair]
    scale: float

    def delta(self, slot: str, x: np.ndarray | QuantizedActivations) -> np.ndarray | None:
        pair = self.pairs.get(slot)
        return None if pair is None else pair.delta(x, self.scale)


@dataclass(eq=False)
class AdapterHandle:
    """A loaded adapter: what :meth:`Model.load_adapter` returns, for ``session(adapter=)``."""

    adapter: LoraAdapter
    digest: bytes  # adapter_digest of its payload
    layers: dict[int, dict[str, LoraPair]] = field(repr=False)

    @property
    def name(self) -> str:
        return self.adapter.name

    @property
    def rank(self) -> int:
        return self.adapter.rank

    @property
    def target_names(self) -> list[str]:
        return self.adapter.target_names

    @property
    def nbytes(self) -> int:
        """Bytes of the factors held in memory (their stored encoding; float16 B as float32)."""
        return sum(p.nbytes for ps in self.layers.values() for p in ps.values())


@dataclass(frozen=True, eq=False)
class ActiveAdapter:
    """A session's choice: ``handle`` at ``scale``, per layer (None where unadapted)."""

    handle: AdapterHandle
    scale: float
    layers: tuple[LayerLora | None, ...]

    @classmethod
    def of(cls, handle: AdapterHandle, scale: float, num_layers: int) -> ActiveAdapter:
        if not math.isfinite(scale):
            raise ValueError(f"adapter_scale must be finite, got {scale}")
        layers = tuple(
            LayerLora(handle.layers[i], scale) if i in handle.layers else None
            for i in range(num_layers)
        )
        return cls(handle, scale, layers)

    @property
    def salt(self) -> bytes:
        """What KV blocks computed under this adapter are keyed by (besides the tokens):
        blocks of another adapter or scale are never shared with this one."""
        return self.handle.digest + np.float64(self.scale).tobytes()


def load_payload(
    payload: bytes, base_digest: bytes, shapes: Mapping[str, tuple[int, ...]], num_layers: int
) -> AdapterHandle:
    """Decode ``payload`` and check it against the base; typed errors say what is wrong."""
    adapter = decode_adapter(payload)
    check_binding(adapter, base_digest, shapes)
    layers: dict[int, dict[str, LoraPair]] = {}
    owned: list[LoraTarget] = []
    for t in adapter.targets:
        index, slot = _slot(t.name, num_layers)
        if slot is None:
            raise AdapterTargetError(
                f"adapter {adapter.name!r} targets {t.name}, which is not applied online "
                "(only layer projections are): merge it with `edgepack merge-lora`"
            )
        layers.setdefault(index, {})[slot], target = _owned(t)
        owned.append(target)
    kept = dataclasses.replace(adapter, targets=tuple(owned))
    return AdapterHandle(kept, adapter_digest(payload), layers)


def _slot(name: str, num_layers: int) -> tuple[int, str | None]:
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
        index = int(parts[1])
        if index < num_layers:
            return index, SLOTS.get(parts[2])
    return -1, None
