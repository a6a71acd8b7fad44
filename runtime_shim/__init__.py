"""edgepack.runtime_shim: what ships inside an app.

It depends only on edgepack.format, numpy and the optional native kernels; never on the
packager, the server, click, boto3, safetensors or gguf (tests/test_runtime_imports.py).
``tokenizers`` and ``jinja2`` are optional and imported lazily, when text is tokenized
or a chat template rendered.

    model = edgepack.runtime_shim.open("chat.epk", trusted_keys=["release.pub"])
    for piece in model.session().generate("The capital of France is", max_tokens=16):
        print(piece, end="")

``open_slot(DIR)`` opens the model active in an update slot directory
(:mod:`edgepack.runtime_shim.update` keeps it current).

The packager's measurements (calibration, sensitivity, device profiles) go through the
public submodule :mod:`edgepack.runtime_shim.instrument`, which apps never import.
The update client records verified installs through :mod:`edgepack.runtime_shim.integrity`
(so that ``open`` may skip re-hashing the weights of a file that provably did not change).
"""

from edgepack.format.errors import (  # what open() raises, catchable from here
    CorruptPackageError,
    EdgepackError,
    IncompatiblePackageError,
    SignatureError,
    TruncatedPackageError,
    UnsupportedFeatureError,
)

from . import integrity
from .capabilities import runtime_capabilities, runtime_version
from .errors import (
    ChatTemplateError,
    KernelStatus,
    KernelUnavailableError,
    KVCacheFullError,
    NumericError,
    RuntimeShimError,
    TokenizerUnavailableError,
)
from .kv_cache import KVCacheConfig
from .model import Model, open
from .sampling import SamplingParams
from .session import Session
from .stats import GenerationStats
from .tokenizer import Tokenizer


def __getattr__(name: str):
    """``open_slot`` lives with the update client; imported on first use (it needs
    nothing beyond the runtime, but its package should not load with every app)."""
    if name == "open_slot":
        from .update.slots import open_slot

        return open_slot
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ChatTemplateError",
    "CorruptPackageError",
    "EdgepackError",
    "GenerationStats",
    "IncompatiblePackageError",
    "KVCacheConfig",
    "KVCacheFullError",
    "KernelStatus",
    "KernelUnavailableError",
    "Model",
    "NumericError",
    "RuntimeShimError",
    "SamplingParams",
    "Session",
    "SignatureError",
    "Tokenizer",
    "TokenizerUnavailableError",
    "TruncatedPackageError",
    "UnsupportedFeatureError",
    "integrity",
    "open",
    "open_slot",
    "runtime_capabilities",
    "runtime_version",
]
