"""Why a layer's int8-activation result is recomputed on the float path, or (``KV_LAYOUT``)
why the native backend runs a layer's attention on numpy instead.

One enum for both backends: the native one is defined in native/src/infer/fallback.h and
exported as ``_kernels.FALLBACK_REASONS`` (``{code: reason}``), which must equal this
mirror (tests/test_runtime_layer_chain.py). A member *is* its reason string, so the
statistics keep counting by reason.
"""

from __future__ import annotations

import enum

__all__ = ["Fallback", "NativeGap"]


class Fallback(str, enum.Enum):
    """A fallback reason; ``code`` is its stable number across the native boundary."""

    ATTENTION_INPUT = "activation scale overflow (attention input)"
    ATTENTION_OUTPUT = "activation scale overflow (attention output)"
    FFN_INPUT = "activation scale overflow (FFN input)"
    FFN_HIDDEN = "activation scale overflow (FFN hidden)"
    HEAD_INPUT = "activation scale overflow (head input)"
    NON_FINITE_KV = "non-finite K/V"
    NON_FINITE_OUTPUT = "non-finite layer output"
    KV_LAYOUT = "KV cache layout not in the native kernels"  # the layer runs on numpy's

    def __str__(self) -> str:  # the reason, in logs and messages
        return self.value

    @property
    def code(self) -> int:
        return _CODES[self]


_CODES = {member: i for i, member in enumerate(Fallback, start=1)}


class NativeGap(str, enum.Enum):
    """Why the native whole-layer call is not taken for a layer: the shared chain
    (:mod:`.layer`) runs it instead, each op native where the extension has it and numpy
    where it does not (named here), so nothing runs approximately. Logged once per reason.
    (GELU/ReLU, sliding windows, score scale and soft-capping, q/k and sandwich norms are
    in the native layer now; only a V group the native cache lacks is left.)"""

    KV_GROUP = "quantized KV cache of a V group or head_dim native lacks (numpy attention)"
    ADAPTER = "a LoRA adapter on the layer (chained native ops plus the adapter's matmuls)"

    def __str__(self) -> str:
        return self.value
