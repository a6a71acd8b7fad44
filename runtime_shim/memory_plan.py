"""Memory planning: offsets in one arena for buffers whose lifetimes are known up front.

A buffer is live from the step it is written first to the step it is read last (both
inclusive). :func:`plan` places the buffers greedily by size, largest first, each at the
lowest aligned offset where it overlaps no placed buffer that is live at the same time
(the "greedy by size" planners of ExecuTorch and TFLite), so buffers that are never live
together share bytes. ``reuse=False`` gives every buffer its own region: the reference a
planned run is compared against. :func:`overlaps` is the verifier: any two buffers live
at once that share a byte. The planner knows nothing about models: the buffers of the
native layer chain are described in :mod:`.kernels.layer_buffers`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ALIGNMENT", "Buffer", "BufferSpec", "MemoryPlan", "check", "overlaps", "plan"]

ALIGNMENT = 64  # bytes: every offset and size (the native Arena rounds requests the same)


@dataclass(frozen=True)
class BufferSpec:
    """A buffer to place: ``nbytes`` live over steps ``first`` .. ``last``."""

    name: str
    nbytes: int
    first: int
    last: int

    def __post_init__(self) -> None:
        if self.nbytes < 0 or self.first > self.last:
            raise ValueError(f"buffer {self.name}: needs nbytes >= 0 and first <= last")

    def live_with(self, other: BufferSpec) -> bool:
        return self.first <= other.last and other.first <= self.last


@dataclass(frozen=True)
class Buffer:
    """A placed buffer: its spec and its offset in the arena."""

    spec: BufferSpec
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.spec.nbytes


@dataclass(frozen=True)
class MemoryPlan:
    """Where each buffer lives; ``nbytes`` is the arena size the plan needs."""

    buffers: tuple[Buffer, ...]
    nbytes: int
    reuse: bool

    def __getitem__(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.spec.name == name:
                return b
        raise KeyError(name)

    @property
    def unshared_bytes(self) -> int:
        """What the buffers would take without reuse."""
        return sum(b.spec.nbytes for b in self.buffers)

    def table(self) -> str:
        """One line per buffer (offset order): name, offset, bytes, live steps."""
        rows = [f"{'buffer':<14} {'offset':>10} {'bytes':>10}  live"]
        for b in sorted(self.buffers, key=lambda b: (b.offset, b.spec.name)):
            s = b.spec
            rows.append(f"{s.name:<14} {b.offset:>10} {s.nbytes:>10}  {s.first}..{s.last}")
        rows.append(f"arena {self.nbytes} bytes ({self.unshared_bytes} without reuse)")
        return "\n".join(rows)


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def plan(specs: Iterable[BufferSpec], reuse: bool = True) -> MemoryPlan:
    """Offsets for ``specs`` (sizes rounded up to :data:`ALIGNMENT`)."""
    specs = [
        BufferSpec(s.name, _aligned(s.nbytes), s.first, s.last) for s in specs if s.nbytes > 0
    ]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("buffer names must be unique")
    placed: list[Buffer] = []
    if not reuse:
        offset = 0
        for s in specs:
            placed.append(Buffer(s, offset))
            offset += s.nbytes
    else:  # largest first; ties by first use, then name: the same plan every time
        for s in sorted(specs, key=lambda s: (-s.nbytes, s.first, s.name)):
            busy = sorted((b.offset, b.end) for b in placed if b.spec.live_with(s))
            offset = 0
            for lo, hi in busy:
                if offset + s.nbytes <= lo:
                    break
                offset = max(offset, hi)
            placed.append(Buffer(s, offset))
    return MemoryPlan(tuple(placed), max((b.end for b in placed), default=0), reuse)


def overlaps(p: MemoryPlan) -> list[tuple[str, str]]:
    """Pairs of buffers live at the same time that share bytes (empty: the plan is sound),
    plus any buffer outside the arena or off alignment, paired with ``"arena"``."""
    bad = [
        (b.spec.name, "arena")
        for b in p.buffers
        if b.offset < 0 or b.end > p.nbytes or b.offset % ALIGNMENT
    ]
    bufs = sorted(p.buffers, key=lambda b: b.offset)
    for i, a in enumerate(bufs):
        for b in bufs[i + 1 :]:
            if b.offset >= a.end:
                break
            if a.spec.live_with(b.spec):
                bad.append((a.spec.name, b.spec.name))
    return bad


def check(p: MemoryPlan) -> MemoryPlan:
    """``p`` if :func:`overlaps` finds nothing; else RuntimeError naming the pairs (a
    planner bug: the layer would read bytes another buffer wrote)."""
    bad = overlaps(p)
    if bad:
        pairs = ", ".join(f"{a}/{b}" for a, b in bad)
        raise RuntimeError(f"memory plan overlaps live buffers: {pairs}")
    return p
