"""Which backend a model runs on: ``EDGEPACK_KERNELS`` / ``open(kernels=...)``, else native
when the extension loads and provides runtime ops; one INFO line says which."""

from __future__ import annotations

import logging
import os

from ..errors import KernelUnavailableError
from .interface import Kernels
from .native_backend import NativeKernels
from .numpy_backend import NumpyKernels

__all__ = ["ENV_VAR", "select_kernels"]

_log = logging.getLogger("edgepack.runtime")

ENV_VAR = "EDGEPACK_KERNELS"


def select_kernels(choice: str | None = None, threads: int | None = None) -> Kernels:
    """``choice``: ``"numpy"``, ``"native"`` or None (``$EDGEPACK_KERNELS``, else auto)."""
    from edgepack import native

    requested = (choice or os.environ.get(ENV_VAR, "") or "auto").strip().lower()
    if requested not in ("auto", "numpy", "native"):
        raise ValueError(f"kernels must be 'numpy', 'native' or 'auto', got {requested!r}")
    if requested == "numpy":
        _log.info("kernels: numpy (forced by %s)", "argument" if choice else f"{ENV_VAR}=numpy")
        return NumpyKernels(threads)
    saved = os.environ.get(ENV_VAR)
    if saved is not None and saved.strip().lower() == "numpy":
        os.environ.pop(ENV_VAR)  # an explicit native choice overrides the variable
    try:
        mod = native.load()
    finally:
        if saved is not None:
            os.environ[ENV_VAR] = saved
    if mod is None:
        if requested == "native":
            raise KernelUnavailableError(
                "native kernels requested but the extension is not available "
                "(build it with `pip install -e .`, or use EDGEPACK_KERNELS=numpy)"
            )
        _log.info("kernels: numpy (native extension unavailable)")
        return NumpyKernels(threads)
    nk = NativeKernels(mod, threads)
    if not nk.implements_any:
        if requested == "native":
            raise KernelUnavailableError(
                "native kernels requested but the extension provides no runtime ops "
                f"(it has: {', '.join(sorted(n for n in dir(mod) if not n.startswith('_')))})"
            )
        nk.close()
        _log.info("kernels: numpy (native extension has no runtime kernels yet)")
        return NumpyKernels(threads)
    if nk.missing:
        _log.warning("native kernels lack %s: using numpy for those ops", ", ".join(nk.missing))
    _log.info("kernels: %s", nk.name)
    return nk
