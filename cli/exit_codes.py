"""Process exit codes of every `edgepack` command, and the one table mapping errors to them.

The README's "Exit codes" table documents the numbers. An error type not in the table
takes the code of its nearest listed base class (method resolution order), so a new
subclass needs a row only when it means something else than its parent. An exception
outside the table is a bug: the entry point reports it as an internal error (exit 1).
"""

from __future__ import annotations

from functools import cache

__all__ = [
    "EXIT_CORRUPT",
    "EXIT_FAILED",
    "EXIT_INCOMPATIBLE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_SIGNATURE",
    "EXIT_USAGE",
    "exit_code_for",
]

EXIT_OK = 0
EXIT_FAILED = 1  # the operation failed (a store, the runtime) or an internal error
EXIT_USAGE = 2  # fix the command line or an input file
EXIT_CORRUPT = 3  # a package, delta, source model or metadata is malformed
EXIT_SIGNATURE = 4  # a signature is missing, bad or untrusted; metadata expired or rolled back
EXIT_INCOMPATIBLE = 5  # well formed, but this runtime cannot honour it
EXIT_INTERRUPTED = 130  # Ctrl-C or an aborted prompt (128 + SIGINT, as shells do)


@cache
def _table() -> dict[type[BaseException], int]:
    """Error type -> exit code. Built on first use: the subsystems' error modules pull in
    their packages, and `edgepack --help` should not pay for that."""
    from edgepack.format.errors import (
        AdapterMismatchError,
        CorruptPackageError,
        EdgepackError,
        EncodingError,
        IncompatiblePackageError,
        InvalidThresholdError,
        OutputPathError,
        RequiredFeatureError,
        SignatureError,
    )
    from edgepack.packager.errors import ImportModelError, InputError
    from edgepack.runtime_shim.errors import InvalidRequestError, UnsupportedModelError
    from edgepack.server.errors import (
        ExpiredMetadataError,
        InvalidStoreURLError,
        MetadataSignatureError,
        ReleasePolicyError,
        RepositoryError,
        RepositoryExistsError,
        RepositoryNotInitializedError,
        RollbackError,
        StoreError,
    )

    return {
        EdgepackError: EXIT_FAILED,
        # format
        CorruptPackageError: EXIT_CORRUPT,
        SignatureError: EXIT_SIGNATURE,
        IncompatiblePackageError: EXIT_INCOMPATIBLE,
        RequiredFeatureError: EXIT_INCOMPATIBLE,  # well formed: a newer reader is the fix
        EncodingError: EXIT_USAGE,
        InvalidThresholdError: EXIT_USAGE,
        OutputPathError: EXIT_USAGE,
        AdapterMismatchError: EXIT_USAGE,  # use the adapter with the base it was made for
        # packager
        ImportModelError: EXIT_CORRUPT,
        InputError: EXIT_USAGE,
        # runtime
        InvalidRequestError: EXIT_USAGE,
        # runtime: a model no edgepack version runs (a newer runtime would not help)
        UnsupportedModelError: EXIT_USAGE,
        # server: stores and release repositories
        StoreError: EXIT_FAILED,
        InvalidStoreURLError: EXIT_USAGE,
        RepositoryError: EXIT_CORRUPT,
        RepositoryNotInitializedError: EXIT_USAGE,
        RepositoryExistsError: EXIT_USAGE,
        MetadataSignatureError: EXIT_SIGNATURE,
        ExpiredMetadataError: EXIT_SIGNATURE,
        RollbackError: EXIT_SIGNATURE,
        ReleasePolicyError: EXIT_USAGE,
        # a path on the command line that is missing, a directory, or not permitted
        FileNotFoundError: EXIT_USAGE,
        IsADirectoryError: EXIT_USAGE,
        PermissionError: EXIT_USAGE,
        FileExistsError: EXIT_USAGE,
        NotADirectoryError: EXIT_USAGE,
        # the environment failed (disk full, read-only filesystem, I/O error)
        OSError: EXIT_FAILED,
    }


def exit_code_for(exc: BaseException) -> int | None:
    """The exit code for ``exc``, or None when it is not an error a user can cause."""
    table = _table()
    return next((table[cls] for cls in type(exc).__mro__ if cls in table), None)
