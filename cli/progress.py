"""Progress bars for long commands: rich on stderr, silent when rich is missing.

One adapter serves every caller. It implements the packager's phase protocol
(:class:`edgepack.packager.build.Progress`: ``phase``, ``advance``, ``log``) and, for
single-task byte counts (convert, verify), ``start(total)``, a phase named after the bar.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

__all__ = ["ProgressBars", "progress_bars"]

Counting = Literal["bytes", "steps"]


class ProgressBars:
    """One rich task per phase; finishing a phase fills its bar. The display starts with
    the first phase, so a command that fails before any work prints only its error."""

    def __init__(
        self,
        make_progress: Callable[[], Any] | None,
        description: str = "",
        console: Any = None,
    ) -> None:
        self._make = make_progress
        self._console = console
        self._p: Any = None
        self._name = description
        self._task = None

    def start(self, total: int) -> None:
        self.phase(self._name, total)

    def phase(self, name: str, total: int) -> None:
        if self._make is None:
            return
        if self._p is None:
            self._p = self._make()
            self._p.start()
        self.finish()
        self._name = name
        self._task = self._p.add_task(name, total=max(total, 1))

    def advance(self, amount: int = 1, detail: str | None = None) -> None:
        if self._p is not None and self._task is not None:
            desc = f"{self._name} {detail}" if detail else self._name
            self._p.update(self._task, advance=amount, description=desc)

    def log(self, message: str) -> None:
        if self._console is not None:
            self._console.print(message)  # above the bars once they are shown

    def finish(self) -> None:
        if self._p is not None and self._task is not None:
            self._p.update(self._task, completed=self._p.tasks[-1].total, description=self._name)

    def stop(self) -> None:
        if self._p is not None:
            self._p.stop()


def _columns(counting: Counting) -> list[Any]:
    from rich import progress as rp

    if counting == "bytes":  # one long task: percent and time left
        return [
            rp.TextColumn("{task.description:<48.48}"),
            rp.BarColumn(),
            rp.TaskProgressColumn(),
            rp.TimeRemainingColumn(),
        ]
    return [  # a sequence of phases: steps done and time spent
        rp.TextColumn("{task.description:<56.56}"),
        rp.BarColumn(),
        rp.MofNCompleteColumn(),
        rp.TimeElapsedColumn(),
        rp.TimeRemainingColumn(),
    ]


@contextmanager
def progress_bars(description: str = "", counting: Counting = "steps") -> Iterator[ProgressBars]:
    """Bars on stderr for the ``with`` body. Byte bars vanish when done on a terminal;
    phase bars stay as a record of where the time went."""
    from .output import quiet_requested

    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        yield ProgressBars(None, description)
        return
    if quiet_requested.get():  # -q or --json: nothing but the result and errors
        yield ProgressBars(None, description)
        return
    console = Console(stderr=True)
    transient = counting == "bytes" and console.is_terminal
    bars = ProgressBars(
        lambda: Progress(*_columns(counting), console=console, transient=transient),
        description,
        console,
    )
    try:
        yield bars
        bars.finish()
    finally:
        bars.stop()
