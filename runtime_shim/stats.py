"""What a user sees about a run: latency, throughput, precision fallbacks, memory."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["ForwardStats", "GenerationStats", "peak_rss_bytes", "rss_bytes"]


@dataclass
class ForwardStats:
    """Counters the forward pass updates (per session, cumulative)."""

    precision_fallbacks: int = 0  # layers recomputed on the float-activation path
    fallback_layers: Counter = field(default_factory=Counter)  # layer index / "head" -> count
    fallback_reasons: Counter = field(default_factory=Counter)
    nonfinite_outputs: int = 0  # float path still produced NaN/Inf (nothing left to try)

    def record_fallback(self, layer: int | str, reason: str) -> None:
        self.precision_fallbacks += 1
        self.fallback_layers[layer] += 1
        self.fallback_reasons[reason] += 1


@dataclass
class GenerationStats:
    """One ``generate``/``chat`` call (``Session.stats``)."""

    kernel_path: str = ""
    kv_mode: str = ""
    activations: str = ""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # reused from this session or the prefix cache
    generated_tokens: int = 0
    time_to_first_token: float = 0.0  # seconds, call start to first sampled token
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    precision_fallbacks: int = 0
    finish_reason: str = ""  # "stop", "length", "eos", "context"
    lookup: str = "off"  # prompt-lookup decoding: "off", "on" or "auto"
    drafted_tokens: int = 0  # draft tokens verified (prompt lookup)
    accepted_tokens: int = 0  # of them, kept
    verify_passes: int = 0  # forward passes that carried a draft

    @property
    def prefill_tokens_per_s(self) -> float:
        computed = self.prompt_tokens - self.cached_prompt_tokens
        return computed / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # the first generated token comes out of prefill; the rest are decode steps
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def summary(self) -> str:
        return (
            f"time to first token {self.time_to_first_token * 1000:.0f} ms | "
            f"prefill {self.prompt_tokens - self.cached_prompt_tokens} tok "
            f"({self.cached_prompt_tokens} cached) {self.prefill_tokens_per_s:.1f} tok/s | "
            f"decode {self.generated_tokens} tok {self.decode_tokens_per_s:.1f} tok/s | "
            f"precision fallbacks {self.precision_fallbacks} | kernels {self.kernel_path} | "
            f"kv {self.kv_mode}"
        )


def _proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes (None: no procfs)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``VmRSS``; 0 where unknown)."""
    return _proc_status_bytes("VmRSS") or 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (0 where unknown).

    Linux: ``VmHWM`` of ``/proc/self/status``; ``getrusage`` would report the parent's
    peak for a process started by fork + exec (Linux keeps ``ru_maxrss`` across exec)."""
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
