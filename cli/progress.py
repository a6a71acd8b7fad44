"""Progress of long commands on stderr, one module for every command.

A job is a sequence of phases, each with a total counted in bytes or steps. Two
renderings of the same phases, chosen by whether stderr is a terminal:

- **terminal**: one live line for the running phase, with its numbers at 80 columns
  (``phase 3/9 sensitivity ━━━━━━ 120/272 15.2/s eta 0:12 total 1:30``: the count, the
  rate, this phase's and the whole job's time left, phases weighted alike); a finished
  phase becomes the plain line below, above the live one;
- **anything else** (CI logs, pipes): exactly one plain line per phase, written when it
  finishes: ``phase 3/9 sensitivity: 272/272 in 12.3 s``. No ``\\r``, no bar.

A phase that does not finish (the command fails) leaves nothing behind, so the error
message is the last line. ``-q`` and ``--json`` turn progress off (stdout stays the
document). The adapter implements the packager's phase protocol
(:class:`edgepack.packager.build.Progress`: ``phase``, ``advance``, ``log``), plus
``plan(names)`` (the phases to come, for the counter and the total ETA) and, for
single-phase jobs, ``start(total)``, a phase named after the job.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["PhaseProgress", "format_bytes", "format_count", "progress_bars"]

Counting = Literal["bytes", "steps"]
_LABEL_WIDTH = 28  # the live line at 80 columns: label, bar, numbers, rate, ETAs


def format_bytes(n: float) -> str:
    """Decimal units, as file managers and ``ls -h --si`` show sizes."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_count(n: float) -> str:
    """Counts as people read them: 272, 12,345, 134.5M."""
    n = int(n)
    if n < 100_000:
        return f"{n:,}"
    return f"{n / 1e6:.1f}M" if n < 10**9 else f"{n / 1e9:.1f}G"


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


@dataclass
class _Phase:
    name: str
    total: int  # 0: unknown (the line shows elapsed time instead of a count)
    counting: Counting
    unit: str = ""  # what a step counts (tensors, weights), shown after the count
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    detail: str | None = None

    def amount(self) -> str:
        if self.counting == "bytes":
            return format_bytes(self.done)
        if not self.total and not self.done:
            return "done"
        count = format_count(self.done)
        if self.total:
            count += f"/{format_count(self.total)}"
        return f"{count} {self.unit}" if self.unit else count

    def fraction(self) -> float:
        return min(self.done / self.total, 1.0) if self.total else 0.0


class PhaseProgress:
    """The phases of one job and their rendering (see the module docstring)."""

    def __init__(
        self,
        description: str = "",
        counting: Counting = "steps",
        *,
        unit: str = "",
        enabled: bool = True,
        live: Any = None,
    ) -> None:
        self._description = description
        self._counting = counting
        self._unit = unit
        self._enabled = enabled
        self._live = live  # a _LiveLine on a terminal, None for plain lines
        self._plan: list[str] = []
        self._phase: _Phase | None = None
        self._job_started = time.monotonic()

    # -- the packager's protocol ------------------------------------------------------
    def plan(self, names: Sequence[str]) -> None:
        """The phases to come, in order: the counter says "phase 3/9" and a total ETA."""
        self._plan = list(names)

    def phase(self, name: str, total: int, counting: Counting | None = None) -> None:
        self.finish()
        if not self._enabled:
            return
        counting = counting or self._counting
        self._phase = _Phase(name, max(int(total or 0), 0), counting, self._unit)
        if self._live is not None:
            self._live.show(self)

    def start(self, total: int) -> None:
        self.phase(self._description, total)

    def advance(self, amount: int = 1, detail: str | None = None) -> None:
        p = self._phase
        if p is None:
            return
        p.done += amount
        p.detail = detail
        if self._live is not None:
            self._live.update(self)

    def log(self, message: str) -> None:
        if not self._enabled:
            return
        if self._live is not None:
            self._live.print(message)
        else:
            print(message, file=sys.stderr, flush=True)

    # -- the job's end ----------------------------------------------------------------
    def finish(self) -> None:
        """The running phase is done: its one line (name, count, duration)."""
        p, self._phase = self._phase, None
        if p is None:
            return
        if p.total and p.done < p.total and p.counting == "steps":
            p.done = p.total  # a phase may skip work it counted (cached, not needed)
        self.log(f"{self.label(p)}: {p.amount()} in {time.monotonic() - p.started:.1f} s")

    def abandon(self) -> None:
        """The job failed: the running phase vanishes, leaving the error the last line."""
        self._phase = None
        if self._live is not None:
            self._live.stop()

    def close(self) -> None:
        self.finish()
        if self._live is not None:
            self._live.stop()

    # -- what the renderings show -----------------------------------------------------
    def label(self, p: _Phase) -> str:
        """``phase 3/9 name`` when the plan is known, else the name."""
        if p.name in self._plan:
            return f"phase {self._plan.index(p.name) + 1}/{len(self._plan)} {p.name}"
        return p.name  # no plan, or a phase it did not foresee

    def total_remaining(self) -> float | None:
        """Seconds left for the whole job, phases weighted alike; None before any data."""
        p = self._phase
        if p is None or p.name not in self._plan or len(self._plan) < 2:
            return None
        fraction = (self._plan.index(p.name) + p.fraction()) / len(self._plan)
        if fraction <= 0:
            return None
        return (time.monotonic() - self._job_started) * (1 / fraction - 1)

    @property
    def current(self) -> _Phase | None:
        return self._phase


class _LiveLine:
    """The running phase as one rich line on the terminal, redrawn in place."""

    def __init__(self, console: Any) -> None:
        from rich.progress import Progress

        self._console = console
        self._progress = Progress(
            *_columns(), console=console, transient=True, redirect_stdout=False
        )
        self._task: Any = None
        self._started = False

    def show(self, job: PhaseProgress) -> None:
        p = job.current
        assert p is not None
        if not self._started:
            self._progress.start()
            self._started = True
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(
            job.label(p), total=p.total or None, job=job, counting=p.counting
        )
        self._progress.refresh()  # every phase is seen once, however short

    def update(self, job: PhaseProgress) -> None:
        p = job.current
        if p is not None and self._task is not None:
            self._progress.update(self._task, completed=p.done)

    def print(self, message: str) -> None:
        if self._task is not None:
            self._progress.remove_task(self._task)  # the finished phase's bar goes
            self._task = None
            self._progress.refresh()  # before the line, or the stale bar is redrawn
        self._console.print(message, highlight=False, markup=False)

    def stop(self) -> None:
        if self._task is not None:
            self._progress.remove_task(self._task)
            self._task = None
        if self._started:
            self._progress.stop()
            self._started = False


def _columns() -> list[Any]:
    """Label, bar, count, rate, this phase's ETA and the job's: 80 columns in all."""
    from rich import progress as rp
    from rich.table import Column
    from rich.text import Text

    class Count(rp.ProgressColumn):
        def render(self, task: Any) -> Text:
            if task.fields["counting"] == "bytes":
                done = format_bytes(task.completed)
                return Text(f"{done}/{format_bytes(task.total)}" if task.total else done)
            if not task.total and not task.completed:
                return Text("")  # a phase without a count: its time spent says it
            done = format_count(task.completed)
            return Text(f"{done}/{format_count(task.total)}" if task.total else done)

    class Rate(rp.ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            if not speed:
                return Text("")
            if task.fields["counting"] == "bytes":
                return Text(f"{format_bytes(speed)}/s")
            return Text(f"{speed:.1f}/s")

    class Remaining(rp.ProgressColumn):
        def render(self, task: Any) -> Text:
            if task.total and task.time_remaining is not None:
                return Text(f"eta {_clock(task.time_remaining)}")
            return Text(_clock(task.elapsed or 0))  # unknown total: time spent

    class Total(rp.ProgressColumn):
        def render(self, task: Any) -> Text:
            left = task.fields["job"].total_remaining()
            return Text(f"total {_clock(left)}" if left is not None else "")

    return [
        rp.TextColumn(
            "{task.description}",
            table_column=Column(width=_LABEL_WIDTH, no_wrap=True, overflow="ellipsis"),
        ),
        rp.BarColumn(bar_width=12),
        Count(),
        Rate(),
        Remaining(),
        Total(),
    ]


@contextmanager
def progress_bars(
    description: str = "",
    counting: Counting = "steps",
    phases: Sequence[str] = (),
    unit: str = "",
) -> Iterator[PhaseProgress]:
    """Progress on stderr for the ``with`` body (see the module docstring); ``phases``
    are the job's phases in order when the command knows them, ``unit`` what a step
    counts."""
    from .output import quiet_requested

    enabled = not quiet_requested.get()  # -q or --json: nothing but the result and errors
    live = None
    if enabled:
        try:
            from rich.console import Console
        except ImportError:  # plain lines
            Console = None
        if Console is not None:
            console = Console(stderr=True)
            if console.is_terminal and not console.is_dumb_terminal:
                live = _LiveLine(console)
    job = PhaseProgress(description, counting, unit=unit, enabled=enabled, live=live)
    job.plan(phases)
    try:
        yield job
    except BaseException:
        job.abandon()
        raise
    job.close()
