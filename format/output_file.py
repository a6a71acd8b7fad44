"""Output files: refuse a target that would destroy something, write it through a
temporary next to it, and clear the temporaries a killed writer left behind.

Every command that writes a file (convert, build, diff, patch, keygen) checks its target
here first, so ``diff -o OLD`` or ``patch -o /dev/full`` cannot replace an input or a
device. The temporary is named ``.<target>.<pid>-<random>.partial`` in the target's
directory (the rename onto the target is then atomic, and a reader never sees a torn
file); a scratch directory (``diff``'s trial patch beside the target, ``build``'s float
reference in RAM or beside it) is named the same way with the suffix ``.verify``.
Staleness rule: a temporary is stale when the process id in its name is not running on
this machine, or, for a name without one, when it is older than
:data:`STALE_AGE_SECONDS`. A live writer's temporary is never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from .errors import OutputPathError

__all__ = [
    "STALE_AGE_SECONDS",
    "check_output_path",
    "create_partial",
    "create_scratch_dir",
    "pid_is_running",
    "pid_temporary_directory",
    "remove_stale_partials",
    "remove_stale_temporary_directories",
]

STALE_AGE_SECONDS = 3600.0  # a temporary without a writer pid is stale after an hour
_PARTIAL_SUFFIX = ".partial"
_SCRATCH_SUFFIX = ".verify"  # a directory beside the target (diff's trial patch)
_PID_PART = re.compile(r"\.(\d+)-[0-9a-z_]+\.(?:partial|verify)")
_MKSTEMP_PART = re.compile(r"\.[0-9a-z_]{8}\.partial")  # older writers: no pid


def check_output_path(
    out: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]] = (),
    *,
    overwrite: bool = False,
) -> Path:
    """Refuse ``out`` if it is one of ``inputs`` (same file under any spelling), exists
    and ``overwrite`` is false, is not a regular file, or its parent is not a directory.
    Returns ``out`` as a Path. Run before any work, so a refusal costs nothing."""
    path = Path(out)
    parent = path.parent
    if not parent.is_dir():
        what = "does not exist" if not parent.exists() else "is not a directory"
        raise OutputPathError(f"cannot write {path}: its directory {parent} {what}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise OutputPathError(f"cannot write {path}: {exc.strerror}") from None
    for given in inputs:
        with contextlib.suppress(OSError):
            other = os.stat(given)
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                raise OutputPathError(
                    f"output {path} is the input {given}: write to another file"
                )
    if not stat.S_ISREG(st.st_mode):
        raise OutputPathError(f"output {path} exists and is not a regular file")
    if not overwrite:
        raise OutputPathError(f"output {path} exists (pass --force to replace it)")
    return path


def create_partial(out: Path) -> tuple[int, Path]:
    """Create the temporary for ``out`` (mode 0600, exclusive); return (fd, path)."""
    for _ in range(100):
        tmp = out.parent / f".{out.name}.{os.getpid()}-{os.urandom(6).hex()}{_PARTIAL_SUFFIX}"
        try:
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary next to {out}")


def create_scratch_dir(out: Path) -> Path:
    """A scratch directory beside ``out`` (same filesystem, so its disk is the one the
    output needs), named like the temporary so a killed writer's is cleared too."""
    prefix = f".{out.name}.{os.getpid()}-"
    return Path(tempfile.mkdtemp(dir=out.parent, prefix=prefix, suffix=_SCRATCH_SUFFIX))


def pid_is_running(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (a zombie counts as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        return fields[0] != b"Z"
    return True


def pid_temporary_directory(
    prefix: str, root: str | os.PathLike[str] | None = None
) -> tempfile.TemporaryDirectory[str]:
    """A scratch directory in ``root`` (default: the system's temporary directory),
    named ``<prefix><pid>-<random>`` so :func:`remove_stale_temporary_directories` can
    tell when its writer is gone."""
    return tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}-", dir=root)


def remove_stale_temporary_directories(
    prefix: str, root: str | os.PathLike[str] | None = None
) -> list[Path]:
    """Delete the :func:`pid_temporary_directory` scratch directories of ``prefix`` in
    ``root`` whose writer pid is not running on this machine; return them."""
    removed: list[Path] = []
    root = Path(root if root is not None else tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            pid = entry.name[len(prefix) :].split("-", 1)[0]
            if entry.name.startswith(prefix) and pid.isdigit() and not pid_is_running(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def remove_stale_partials(out: str | os.PathLike[str]) -> list[Path]:
    """Delete the stale temporaries of ``out`` (see the module's rule); return them."""
    path = Path(out)
    removed: list[Path] = []
    prefix = f".{path.name}."
    try:
        names = [n for n in os.listdir(path.parent) if n.startswith(prefix)]
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.endswith((_PARTIAL_SUFFIX, _SCRATCH_SUFFIX)):
            continue
        tmp = path.parent / name
        if not _is_stale(name[len(path.name) + 1 :], tmp, now):
            continue
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
            continue
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed.append(tmp)
    return removed


def _is_stale(tail: str, tmp: Path, now: float) -> bool:
    """``tail`` is the temporary's name after ``.<target>``."""
    match = _PID_PART.fullmatch(tail)
    if match:
        return not pid_is_running(int(match.group(1)))
    if not _MKSTEMP_PART.fullmatch(tail):
        return False  # another target's temporary (".a.epk.b.epk...")
    try:
        return now - tmp.lstat().st_mtime > STALE_AGE_SECONDS
    except OSError:
        return False
