"""The `edgepack` command: runs the group of :mod:`.app` and turns errors into exit codes.

Exit codes are shared by every command (README; the numbers and the one table mapping
error types to them are in :mod:`.exit_codes`): 0 ok, 2 usage, 3 corrupt or malformed,
4 signature, 5 incompatible with this runtime, 1 a failed operation or internal error.
Errors print one line on stderr, never a traceback (set EDGEPACK_DEBUG=1 for one); a
command given ``--json`` also prints ``{"error": {"type", "message", "exit_code"}}`` on
stdout. An OS error that reaches here is the environment failing (disk full, read-only
filesystem): its own line, exit 1, never "internal error".
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from .exit_codes import EXIT_INTERRUPTED, EXIT_USAGE

    try:
        import click
    except ImportError:
        print("error: the edgepack command needs `pip install edgepack[build]`", file=sys.stderr)
        return EXIT_USAGE
    from .app import make_cli
    from .options import json_requested
    from .output import reset_cli_logging

    reset_cli_logging()
    token = json_requested.set(False)
    try:
        rv = make_cli().main(args=argv, prog_name="edgepack", standalone_mode=False)
    except click.exceptions.Abort as exc:
        return _fail(exc, "aborted", EXIT_INTERRUPTED)
    except click.exceptions.ClickException as exc:
        if not json_requested.get():
            exc.show()
            return EXIT_USAGE if isinstance(exc, click.UsageError) else exc.exit_code
        code = EXIT_USAGE if isinstance(exc, click.UsageError) else exc.exit_code
        return _fail(exc, exc.format_message(), code)
    except KeyboardInterrupt as exc:
        return _fail(exc, "interrupted", EXIT_INTERRUPTED)
    except Exception as exc:
        _debug()
        return _fail_typed(exc)
    finally:
        json_requested.reset(token)
    return rv if isinstance(rv, int) else 0


def _fail_typed(exc: Exception) -> int:
    """Report ``exc`` by the exit code table; an error outside it is a bug."""
    from .exit_codes import EXIT_FAILED, exit_code_for

    code = exit_code_for(exc)
    if code is None:  # a bug: still one line, with a way to get the traceback
        message = f"{type(exc).__name__}: {exc} (EDGEPACK_DEBUG=1 for a traceback)"
        return _fail(exc, message, EXIT_FAILED, prefix="internal error")
    return _fail(exc, _describe(exc), code)


def _describe(exc: Exception) -> str:
    """The message of ``exc``; for an OS error, what failed and on which file, without
    Python's ``[Errno N]`` prefix."""
    if isinstance(exc, OSError) and exc.strerror:
        where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        return f"{exc.strerror}: {where}" if where else exc.strerror
    return str(exc)


def _fail(exc: BaseException, message: str, code: int, *, prefix: str = "error") -> int:
    """Print the one error line on stderr and, under ``--json``, the JSON error object
    on stdout; return ``code``."""
    from .options import json_requested

    line = _one_line(f"{prefix}: {message}")
    print(line, file=sys.stderr)
    if json_requested.get():
        error = {"type": type(exc).__name__, "message": line.split(": ", 1)[1], "exit_code": code}
        print(json.dumps({"error": error}), flush=True)
    return code


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def _debug() -> None:
    if os.environ.get("EDGEPACK_DEBUG"):
        import traceback

        traceback.print_exc()


def entry_point() -> None:
    sys.exit(main())
