"""Errors the runtime shim raises, all under :class:`edgepack.format.errors.EdgepackError`.

Package problems reuse the format's types (``CorruptPackageError``, ``SignatureError``,
``IncompatiblePackageError``); what is specific to running a model lives here.
"""

from __future__ import annotations

import enum

from edgepack.format.errors import (
    AdapterBaseError,
    AdapterMismatchError,
    AdapterTargetError,
    CorruptPackageError,
    EdgepackError,
    IncompatiblePackageError,
)

__all__ = [
    "AdapterBaseError",  # the adapter errors live in the format's tree (merge raises them too)
    "AdapterMismatchError",
    "AdapterTargetError",
    "ChatTemplateError",
    "CorruptSessionError",
    "InvalidRequestError",
    "KVCacheFullError",
    "KernelStatus",
    "KernelUnavailableError",
    "NumericError",
    "RuntimeShimError",
    "SessionMismatchError",
    "TokenizerUnavailableError",
    "UnsupportedModelError",
]


class RuntimeShimError(EdgepackError):
    """Running a (valid, compatible) package failed."""


class InvalidRequestError(RuntimeShimError, ValueError):
    """A request the runtime cannot serve as given: an empty prompt, a prompt longer than
    the model's context, trusted keys with nothing checking them, packages that cannot
    be compared. Fix the arguments. (Also a ValueError, as API misuse always was.)"""


class UnsupportedModelError(IncompatiblePackageError):
    """The model uses a config key or value no edgepack version implements (a model type,
    an activation, a RoPE scaling): refused at convert/build and at open. Unlike its base,
    updating the runtime does not help, so it has its own exit code. ``key`` names the
    config key (see :mod:`edgepack.runtime_shim.config_table`)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


class KVCacheFullError(RuntimeShimError):
    """Every KV block is in use by a live sequence: raise the budget or end sessions."""


class SessionMismatchError(RuntimeShimError):
    """A saved session was made on other weights, another adapter or KV layout (or
    tokenizer, template, RoPE): restoring it would run silently wrong, so it is refused.
    ``field`` names the binding field (:class:`edgepack.format.prefix_cache.KVBinding`)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class CorruptSessionError(CorruptPackageError):
    """A saved session file is not one: bad magic, truncated, or its hash does not match."""


class KernelUnavailableError(RuntimeShimError):
    """``kernels="native"`` (or ``EDGEPACK_KERNELS=native``) was forced but cannot be used."""


class ChatTemplateError(RuntimeShimError):
    """The package has no chat template, or it needs jinja2 and jinja2 is not installed."""


class TokenizerUnavailableError(RuntimeShimError):
    """The package has no tokenizer, or its kind needs the ``tokenizers`` package."""


class KernelStatus(enum.IntEnum):
    """Why a native kernel stopped: the numbering of ``Status`` in native/src/kernels.h
    (exported as ``_kernels.STATUS_CODES``; tests/test_runtime_errors.py checks them
    equal). Errors raised for one carry it as ``.code``."""

    OK = 0
    NON_FINITE = 1  # NaN/Inf in the input
    SCALE_OVERFLOW = 2  # a float16 scale does not fit
    MIN_OVERFLOW = 3  # a float16 min does not fit
    BAD_SHAPE = 4
    BAD_DTYPE = 5


class NumericError(RuntimeShimError, FloatingPointError):
    """NaN/Inf, or a scale beyond float16, met while quantizing activations or the KV
    cache; raised by the numpy and the native kernels alike.

    ``code`` is the :class:`KernelStatus`; ``op`` the kernel, ``row`` / ``col`` where
    (-1 when unknown). On the int8-activation path the runtime recomputes the layer with
    float activations instead of raising; seen by a caller, the input (or the model's
    weights) hold non-finite values.
    """

    def __init__(
        self,
        message: str,
        code: int = KernelStatus.NON_FINITE,
        op: str = "",
        row: int = -1,
        col: int = -1,
    ) -> None:
        super().__init__(message)
        self.code = KernelStatus(code)
        self.op = op
        self.row = row
        self.col = col

    @property
    def kind(self) -> str:
        """``"scale_overflow"`` or ``"non_finite"`` (the status as a word)."""
        return "scale_overflow" if self.code == KernelStatus.SCALE_OVERFLOW else "non_finite"
