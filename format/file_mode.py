"""The mode of a file written through a temporary file: what ``open()`` would give it.

``tempfile.mkstemp`` creates files 0600 whatever the umask, which is right for keys and
wrong for packages and deltas: a web server or CDN sync running as another user must be
able to read them. Call :func:`honour_umask` on the temporary file before renaming it.
"""

from __future__ import annotations

import os
import threading

__all__ = ["honour_umask", "seal_output"]

_LOCK = threading.Lock()  # os.umask can only be read by setting it


def _umask() -> int:
    with _LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def honour_umask(fd: int) -> None:
    """Give the open file ``fd`` mode 0666 minus the process umask."""
    os.fchmod(fd, 0o666 & ~_umask())


def seal_output(f) -> None:
    """Before a written temporary is renamed onto its output: its bytes on disk
    (``flush`` + ``fsync``) and the mode ``open()`` would have given it. ``f``: an open
    binary file object or a file descriptor."""
    if isinstance(f, int):
        fd = f
    else:
        f.flush()
        fd = f.fileno()
    honour_umask(fd)
    os.fsync(fd)
