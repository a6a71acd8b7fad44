"""Progress bars for long commands (rich, on stderr; silent when rich is missing)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class _Bar:
    def __init__(self, progress, description: str) -> None:
        self._progress = progress
        self._description = description
        self._task = None

    def start(self, total: int) -> None:
        if self._progress is not None:
            self._task = self._progress.add_task(self._description, total=total)

    def advance(self, amount: int, detail: str | None = None) -> None:
        if self._progress is not None and self._task is not None:
            desc = f"{self._description} {detail}" if detail else self._description
            self._progress.update(self._task, advance=amount, description=desc)


@contextmanager
def byte_progress(description: str, unit: str = "bytes") -> Iterator[_Bar]:
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
        )
    except ImportError:
        yield _Bar(None, description)
        return
    console = Console(stderr=True)
    columns = [
        TextColumn("{task.description:<48.48}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=console.is_terminal) as progress:
        yield _Bar(progress, description)
