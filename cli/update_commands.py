"""``edgepack update``: the device client run once (listed in
:data:`edgepack.cli.app.COMMAND_MODULES`). The work is :class:`Updater`'s; this only
parses options and prints its :class:`UpdateResult`."""

from __future__ import annotations

import json

import click

from .exit_codes import EXIT_FAILED
from .options import json_option, trusted_key_option


@click.command()
@click.option("--server", "server_url", required=True, help="Base URL of `edgepack serve`.")
@click.option(
    "--slot-dir", required=True, type=click.Path(file_okay=False),
    help="Slot directory (two A/B slots, the journal, TUF metadata, downloads).",
)
@click.option("--device-id", required=True, help="This device's id (staged rollouts).")
@click.option("--channel", required=True, help="Release channel to follow.")
@click.option(
    "--trusted-root", type=click.Path(exists=True, dir_okay=False),
    help="TUF root.json to trust on first use (afterwards the slot directory's own).",
)
@click.option("--model", default=None, help="Model name to install (default: the installed one).")
@trusted_key_option("Ed25519 key (NAME.pub) staged packages must be signed by; repeatable.")
@json_option("the result")
def update(
    server_url: str,
    slot_dir: str,
    device_id: str,
    channel: str,
    trusted_root: str | None,
    model: str | None,
    trusted_keys: tuple,
    as_json: bool,
) -> int:
    """Check for an update and install it (delta first) into the inactive slot, switch,
    health-check and switch back on failure. Safe to kill at any instant: the next run
    resumes."""
    from edgepack.runtime_shim.update import Updater

    updater = Updater(
        server_url, slot_dir, trusted_root, device_id=device_id, channel=channel,
        model=model, package_keys=list(trusted_keys) or None,
    )
    result = updater.check_and_apply()
    code = 0 if result.result in ("updated", "up_to_date") else EXIT_FAILED
    if as_json:
        document = result.to_json()
        if code:  # the error object every command prints on failure (edgepack.cli.main)
            message = result.reason or result.result
            document["error"] = {"type": result.error or "UpdateFailed", "message": message,
                                 "exit_code": code}
        click.echo(json.dumps(document, sort_keys=True))
    else:
        click.echo(
            f"{result.result}: plan {result.plan}, version {result.version}, "
            f"{result.bytes_downloaded} of {result.full_bytes} bytes downloaded"
            + (f" ({result.reason})" if result.reason else "")
        )
    return code


COMMANDS = [update]
