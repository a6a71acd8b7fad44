"""edgepack: packaging, versioning and over-the-air delivery of on-device LLMs.

The subpackages are ``edgepack.format``, ``edgepack.runtime_shim`` (what an app ships),
``edgepack.packager``, ``edgepack.server`` and ``edgepack.cli``. This module imports
none of them and nothing else at import time: ``import edgepack.runtime_shim`` pays
nothing for it. ``edgepack.__version__`` is the installed distribution's version, whose
one source is ``pyproject.toml`` (the install writes it to ``_version.py``); it is read on
first use.
"""

from __future__ import annotations

__all__ = ["__version__"]

_UNKNOWN = "0.0.0+unknown"  # the files are importable without an installed distribution


def _installed_version() -> str:
    try:  # written by the install (pyproject's [[tool.scikit-build.generate]])
        from ._version import version  # type: ignore[import-not-found]
    except ImportError:  # a source tree on sys.path: ask the distribution, if any
        pass
    else:
        return version
    from importlib import metadata

    try:
        return metadata.version("edgepack")
    except metadata.PackageNotFoundError:
        return _UNKNOWN


def __getattr__(name: str) -> str:
    if name == "__version__":
        version = _installed_version()
        globals()["__version__"] = version  # read once
        return version
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
