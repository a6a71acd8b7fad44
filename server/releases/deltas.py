"""The one place publishing calls the tensor-aware delta codec.

The codec lives in ``edgepack.server.delta`` (create side: ``create_delta(old, new, out,
*, signing_keys=())``, which verifies its output by applying it). When it is not installed
(or not written yet) publishing carries on without precomputed deltas and says so
once in the log; a codec failure on one pair skips that pair, never the publish.
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path

__all__ = ["DELTA_SUFFIX", "delta_codec_available", "make_delta"]

DELTA_SUFFIX = ".epkd"
log = logging.getLogger("edgepack.server.releases")
_warned = False


def _codec():
    """The codec's create function, or None (logged once per process)."""
    global _warned
    reason = ""
    try:
        codec = importlib.import_module("edgepack.server.delta")
    except ImportError as exc:
        codec, reason = None, str(exc)
    # `create_delta` is the codec's name for it; `build_delta` the name first agreed on
    fn = getattr(codec, "create_delta", None) or getattr(codec, "build_delta", None)
    if fn is None and not _warned:
        log.warning(
            "precomputed deltas skipped: the delta codec (edgepack.server.delta) is not "
            "available (%s)",
            reason or "it has no create_delta",
        )
        _warned = True
    return fn


def delta_codec_available() -> bool:
    return _codec() is not None


def make_delta(
    old_path: str | os.PathLike[str],
    new_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    signing_keys: tuple = (),
) -> Path | None:
    """Write the delta OLD -> NEW to ``out_path``; None when no delta could be made."""
    create = _codec()
    if create is None:
        return None
    out = Path(out_path)
    try:
        create(os.fspath(old_path), os.fspath(new_path), os.fspath(out), signing_keys=signing_keys)
    except Exception as exc:  # an optimisation failing must not fail the publish
        log.warning(
            "delta %s -> %s skipped: %s: %s",
            Path(old_path).name,
            Path(new_path).name,
            type(exc).__name__,
            exc,
        )
        out.unlink(missing_ok=True)
        return None
    if not out.is_file() or out.stat().st_size == 0:
        log.warning("delta codec wrote no output for %s", out.name)
        return None
    return out
