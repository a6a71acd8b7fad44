"""Loader for the compiled kernels (``edgepack.native._kernels``).

The extension is optional: callers ask :func:`load` and fall back to the numpy reference
in :mod:`edgepack.format.codecs` when it returns ``None``.  Both produce identical bytes.
Set ``EDGEPACK_KERNELS=numpy`` to force the fallback.  Import-light on purpose: this runs
inside apps.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

__all__ = ["ENV_VAR", "load"]

ENV_VAR = "EDGEPACK_KERNELS"

_log = logging.getLogger("edgepack.native")
_MISSING = object()
_module: object = _MISSING  # import attempted once, then cached (module or None)
_logged: set[str] = set()


def _log_once(level: int, msg: str, *args: object) -> None:
    key = msg % args
    if key not in _logged:
        _logged.add(key)
        _log.log(level, msg, *args)


def load() -> ModuleType | None:
    """Return the native kernel module, or ``None`` to use the numpy reference."""
    global _module
    if os.environ.get(ENV_VAR, "").strip().lower() == "numpy":
        _log_once(logging.INFO, "kernels: numpy reference (%s=numpy)", ENV_VAR)
        return None
    if _module is _MISSING:
        try:
            _module = importlib.import_module("edgepack.native._kernels")
        except ImportError as exc:  # not built, or built for another platform
            _module = None
            level = logging.INFO if isinstance(exc, ModuleNotFoundError) else logging.WARNING
            _log_once(level, "kernels: numpy reference (native extension unavailable: %s)", exc)
    if _module is None:
        return None
    assert isinstance(_module, ModuleType)
    _log_once(logging.INFO, "kernels: native, isa=%s", _module.active_isa())
    return _module
