"""The `edgepack` command. Exit codes are shared by every command (README):
0 ok, 2 usage, 3 corrupt or malformed, 4 signature, 5 incompatible with this runtime.

Errors print one line on stderr, never a traceback (set EDGEPACK_DEBUG=1 for one).
"""

from __future__ import annotations

import os
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    try:
        import click
    except ImportError:
        print("error: the edgepack command needs `pip install edgepack[build]`", file=sys.stderr)
        return 2
    from edgepack.format.errors import EXIT_USAGE, EdgepackError

    from .commands import cli

    try:
        rv = cli.main(args=argv, prog_name="edgepack", standalone_mode=False)
    except click.exceptions.Abort:
        print("error: aborted", file=sys.stderr)
        return 130
    except click.exceptions.ClickException as exc:
        exc.show()
        return EXIT_USAGE if isinstance(exc, click.UsageError) else exc.exit_code
    except EdgepackError as exc:
        _debug()
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (FileNotFoundError, IsADirectoryError, PermissionError, FileExistsError) as exc:
        _debug()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still one line, with a way to get the traceback
        _debug()
        print(
            f"internal error: {type(exc).__name__}: {exc} (EDGEPACK_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return 1
    return rv if isinstance(rv, int) else 0


def _debug() -> None:
    if os.environ.get("EDGEPACK_DEBUG"):
        import traceback

        traceback.print_exc()


def entry_point() -> None:
    sys.exit(main())
