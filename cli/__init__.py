"""The `edgepack` command: runs the group of :mod:`.app` and turns errors into exit codes.

Exit codes are shared by every command (README; the numbers and the one table mapping
error types to them are in :mod:`.exit_codes`): 0 ok, 2 usage, 3 corrupt or malformed,
4 signature, 5 incompatible with this runtime, 1 a failed operation or internal error.
Errors print one line on stderr, never a traceback (set EDGEPACK_DEBUG=1 for one).
"""

from __future__ import annotations

import os
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from .exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, exit_code_for

    try:
        import click
    except ImportError:
        print("error: the edgepack command needs `pip install edgepack[build]`", file=sys.stderr)
        return EXIT_USAGE
    from .app import make_cli

    try:
        rv = make_cli().main(args=argv, prog_name="edgepack", standalone_mode=False)
    except click.exceptions.Abort:
        print("error: aborted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except click.exceptions.ClickException as exc:
        exc.show()
        return EXIT_USAGE if isinstance(exc, click.UsageError) else exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        _debug()
        code = exit_code_for(exc)
        if code is None:  # a bug: still one line, with a way to get the traceback
            msg = f"internal error: {type(exc).__name__}: {exc} (EDGEPACK_DEBUG=1 for a traceback)"
            print(_one_line(msg), file=sys.stderr)
            return EXIT_FAILED
        print(_one_line(f"error: {exc}"), file=sys.stderr)
        return code
    return rv if isinstance(rv, int) else 0


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def _debug() -> None:
    if os.environ.get("EDGEPACK_DEBUG"):
        import traceback

        traceback.print_exc()


def entry_point() -> None:
    sys.exit(main())
