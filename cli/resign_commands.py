"""`edgepack resign`: a new name, version or signature for a finished package.

Re-versioning a release (versions on a channel only go up) or signing it with another
key should not mean rebuilding it: the data region is copied as it is
(:mod:`edgepack.format.resign`).
"""

from __future__ import annotations

import click

from .options import model_name_value, output_option, semver_value, sign_key_option
from .output import record


@click.command()
@click.argument("package", type=click.Path(exists=True, dir_okay=False))
@output_option("Package to write (a new file; the input is never changed).", inputs=("package",))
@click.option(
    "--model-version",
    default=None,
    metavar="VERSION",
    callback=semver_value,
    help="New semantic version (default: kept).",
)
@click.option(
    "--model-name",
    default=None,
    metavar="NAME",
    callback=model_name_value,
    help="New model name (default: kept).",
)
@sign_key_option("the new header")
def resign(
    package: str,
    out: str,
    model_version: str | None,
    model_name: str | None,
    sign_keys: tuple[str, ...],
) -> None:
    """Rewrite PACKAGE's header (name, version) and signature; the data is not re-encoded."""
    from edgepack.format import load_private_key
    from edgepack.format.resign import resign as run_resign

    if not sign_keys:
        raise click.UsageError("give at least one --sign-key: resign writes a new signature")
    keys = [load_private_key(k) for k in sign_keys]
    result = run_resign(package, out, signing_keys=keys, name=model_name, version=model_version)
    record(
        path=out,
        name=result.identity.name,
        version=result.identity.version,
        signatures=result.signatures,
        data_moved=result.data_moved,
    )
    where = "data moved to make room" if result.data_moved else "data region unchanged"
    click.echo(
        f"wrote {out}: {result.identity.name} {result.identity.version}, signed by "
        f"{result.signatures} key(s); {where}"
    )


COMMANDS = [resign]
