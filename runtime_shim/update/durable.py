"""Durable file operations: data fsync, rename, directory fsync, in that order.

A rename is only durable once its directory is synced; a journal entry written before
the file it names is durable could name a file a power cut erased. Every state change
of the slot directory goes through here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "fsync_file", "replace_durably", "write_json_durably"]


def fsync_file(path: Path) -> None:
    _fsync(path, os.O_RDONLY)


def fsync_dir(path: Path) -> None:
    _fsync(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(src: Path, dest: Path) -> None:
    """``src`` (written, not yet synced) becomes ``dest``, surviving a power cut."""
    fsync_file(src)
    os.replace(src, dest)
    fsync_dir(dest.parent)


def write_json_durably(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
