"""A model's layer arena: the activation buffer of its native layers, planned at open.

Two plans share one buffer: prefill (``prefill_chunk`` tokens, which sizes it) and decode
(one token); a call of T tokens uses the smaller plan that holds T. Both are verified
(:func:`~.memory_plan.check`) before the buffer is allocated. A session's adapter of a
larger rank than planned for replans once (its buffers are per rank). Kernels without a
native layer get no buffer (``nbytes`` 0): the numpy chain allocates its own arrays.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from .kernels.layer_buffers import LayerShape, layer_buffers
from .memory_plan import MemoryPlan, check, plan
from .weights import LayerWeights

__all__ = ["REUSE_ENV", "ModelArena"]

_log = logging.getLogger("edgepack.runtime")

REUSE_ENV = "EDGEPACK_ARENA_REUSE"  # "0": every buffer its own region (the reference run)


class ModelArena:
    """The planned arena of one model (``Model.arena``); ``native_for(adapter)`` is the
    object its layers take as ``ctx.arena`` (None: unplanned)."""

    def __init__(
        self,
        layers: Sequence[LayerWeights],
        shape: LayerShape,
        prefill_tokens: int,
        act_int8: bool,
        kernels: Any,
        reuse: bool | None = None,
    ) -> None:
        self._layers, self._shape, self._act_int8 = layers, shape, act_int8
        self._tokens = sorted({1, max(1, prefill_tokens)})
        self._make = getattr(kernels, "layer_arena", None)
        self.reuse = os.environ.get(REUSE_ENV, "1") != "0" if reuse is None else reuse
        self.lora_rank = -1
        self.plans: dict[int, MemoryPlan] = {}
        self.native: Any = None
        self._build(0)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer allocated (0: none)."""
        return 0 if self.native is None else int(self.native.nbytes)

    def native_for(self, adapter: Any = None) -> Any:
        rank = 0 if adapter is None else int(adapter.handle.rank)
        if rank > self.lora_rank:
            self._build(rank)
        return self.native

    def _build(self, lora_rank: int) -> None:
        self.plans = {
            t: check(
                plan(
                    layer_buffers(self._layers, self._shape, t, self._act_int8, lora_rank),
                    self.reuse,
                )
            )
            for t in self._tokens
        }
        self.lora_rank = lora_rank
        if self._make is None:
            return
        nbytes = max(p.nbytes for p in self.plans.values())
        spans = [
            (t, {b.spec.name: (b.offset, b.spec.nbytes) for b in p.buffers})
            for t, p in self.plans.items()
        ]
        self.native = None  # the old buffer goes before the new one is allocated
        self.native = self._make(nbytes, spans)
        if _log.isEnabledFor(logging.DEBUG):
            for t, p in self.plans.items():
                _log.debug("layer arena plan for %d tokens:\n%s", t, p.table())
