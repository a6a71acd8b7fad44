"""``--json`` and ``-q/--quiet`` on every command, added in one place (:func:`add_output_flags`).

A command that declares ``as_json`` itself (with :func:`.options.json_option`) prints its
own JSON document. For any other, ``--json`` captures what it would print on stdout and
prints one document instead, ``{"command": ..., "output": [lines], "result": {...}}``
(``result``: the facts the command gave :func:`record`: paths, sizes, versions), so every
command answers in JSON on success as on error (errors: :func:`edgepack.cli.main`).
``-q``, like ``grep -q``, prints nothing on stdout on success but a requested JSON
document, and turns progress bars off (:data:`quiet_requested`); errors and warnings
still go to stderr. ``run`` and ``serve`` declare their own ``-q`` (see their help).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import math
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TextIO

import click

from .options import json_flag

__all__ = [
    "add_output_flags",
    "json_text",
    "log_to_stderr",
    "quiet_flag",
    "quiet_requested",
    "record",
    "reset_cli_logging",
]

# Read by :func:`.progress.progress_bars`: no bars under ``-q`` or ``--json``.
quiet_requested: ContextVar[bool] = ContextVar("quiet_requested", default=False)
_facts: ContextVar[dict[str, Any] | None] = ContextVar("_facts", default=None)


def record(**facts: Any) -> None:
    """Add ``facts`` (JSON values) to the ``result`` of the ``--json`` document: what
    the command's text line says, for a program to read without parsing it. A command
    that fails by returning an exit code records ``error={"type", "message"}``."""
    current = _facts.get()
    if current is not None:
        current.update(facts)


def json_text(document: Any) -> str:
    """``document`` as strict JSON: a non-finite float (an SNR of identical tensors) is
    written as the string ``"inf"``/``"-inf"``/``"nan"``, never as bare ``Infinity``."""

    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(document), default=str, allow_nan=False)


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged, so a handler left by
    an earlier command of this process (tests, embedding apps) never writes to a
    stream that has since been closed or replaced."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def reset_cli_logging() -> None:
    """Remove what an earlier command of this process set on the ``edgepack`` logger
    (tests and apps run several commands in one process): each command starts quiet."""
    logger = logging.getLogger("edgepack")
    for h in [h for h in logger.handlers if getattr(h, "_edgepack_cli", False)]:
        logger.removeHandler(h)
    logger.setLevel(logging.NOTSET)


def log_to_stderr(formatter: logging.Formatter, level: int) -> None:
    """Send the ``edgepack`` logger's lines to the current stderr, replacing the handler
    an earlier command of this process added."""
    logger = logging.getLogger("edgepack")
    reset_cli_logging()
    handler = _CurrentStderr()
    handler.setFormatter(formatter)
    handler._edgepack_cli = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)


def add_output_flags(command: click.Command) -> None:
    """Give ``command`` (every leaf of a group) ``--json`` and ``-q`` where it lacks them."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            add_output_flags(sub)
        return
    if command.callback is None or getattr(command.callback, "_output_flags", False):
        return
    names = {p.name for p in command.params}
    own_json, own_quiet = "as_json" in names, "quiet" in names
    if not own_json:
        command.params.append(json_flag("the result (its stdout lines) in one document"))
    if not own_quiet:
        command.params.append(quiet_flag())
    command.callback = _wrap(command.callback, own_json, own_quiet)


def quiet_flag() -> click.Option:
    """``-q/--quiet``, passed as ``quiet``. A command that declares it itself (``run``:
    the generated text is its result) decides what it still prints."""
    return click.Option(
        ["-q", "--quiet"],
        is_flag=True,
        help="No progress bars and nothing on stdout on success (but a --json document); "
        "errors and warnings still print.",
    )


def _wrap(callback: Callable[..., Any], own_json: bool, own_quiet: bool) -> Callable[..., Any]:
    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        as_json = kwargs["as_json"] if own_json else kwargs.pop("as_json")
        quiet = kwargs["quiet"] if own_quiet else kwargs.pop("quiet")
        token = quiet_requested.set(quiet or as_json)
        facts_token = _facts.set({})
        try:
            prints_own_document = own_json and as_json
            silenced = (quiet and not own_quiet) or as_json
            if prints_own_document or not silenced:
                return callback(*args, **kwargs)
            with contextlib.redirect_stdout(io.StringIO()) as captured:
                rv = callback(*args, **kwargs)
            if as_json:  # a command without a document of its own: its lines
                name = click.get_current_context().command_path
                facts = _facts.get() or {}
                failure = facts.pop("error", {})  # what a command failing by its code said
                lines = captured.getvalue().splitlines()
                document = {"command": name, "output": lines, "result": facts}
                if isinstance(rv, int) and rv:  # failed without raising (repo verify)
                    message = f"{name} failed (exit {rv})"
                    document["error"] = {"type": "Failed", "message": message, **failure,
                                         "exit_code": rv}
                click.echo(json_text(document))
            return rv
        finally:
            _facts.reset(facts_token)
            quiet_requested.reset(token)

    run._output_flags = True  # type: ignore[attr-defined]
    return run
