"""Errors the runtime shim raises, all under :class:`edgepack.format.errors.EdgepackError`.

Package problems reuse the format's types (``CorruptPackageError``, ``SignatureError``,
``IncompatiblePackageError``); what is specific to running a model lives here.
"""

from __future__ import annotations

from edgepack.format.errors import EdgepackError

__all__ = [
    "ChatTemplateError",
    "KVCacheFullError",
    "KernelUnavailableError",
    "RuntimeShimError",
    "TokenizerUnavailableError",
]


class RuntimeShimError(EdgepackError):
    """Running a (valid, compatible) package failed."""


class KVCacheFullError(RuntimeShimError):
    """Every KV block is in use by a live sequence: raise the budget or end sessions."""


class KernelUnavailableError(RuntimeShimError):
    """``kernels="native"`` (or ``EDGEPACK_KERNELS=native``) was forced but cannot be used."""


class ChatTemplateError(RuntimeShimError):
    """The package has no chat template, or it needs jinja2 and jinja2 is not installed."""


class TokenizerUnavailableError(RuntimeShimError):
    """The package has no tokenizer, or its kind needs the ``tokenizers`` package."""
