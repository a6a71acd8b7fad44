"""What this runtime supports, declared once for compatibility checks (device and server).

Operators are named ``<family>.<name>`` with an integer version. ``decode.*`` are the
tensor decoders of quantization schema 1 (numpy reference in edgepack.format.codecs,
native kernels where built); ``arch.*`` are the model architectures the shim runs.
"""

from __future__ import annotations

from edgepack.format import Encoding, RuntimeCapabilities
from edgepack.format.constants import LORA_OPERATOR
from edgepack.format.encodings import REGISTRY

__all__ = ["RUNTIME_OPERATORS", "runtime_capabilities", "runtime_version"]

# every encoding's decoder (edgepack.format.codecs, native kernels where built), version 1
RUNTIME_OPERATORS: dict[str, int] = {
    **{r.operator: 1 for r in REGISTRY},
    "arch.llama": 1,
    LORA_OPERATOR: 1,  # LORA_ADAPTER sections applied per session (runtime_shim/adapters)
}


def runtime_version() -> str:
    """This edgepack's version (``edgepack.__version__``: the installed distribution's)."""
    import edgepack

    return edgepack.__version__


def runtime_capabilities() -> RuntimeCapabilities:
    return RuntimeCapabilities(
        runtime_version=runtime_version(),
        operators=dict(RUNTIME_OPERATORS),
        encodings=frozenset(int(e) for e in Encoding),
    )
