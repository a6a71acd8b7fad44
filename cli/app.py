"""The `edgepack` click group, assembled from the command modules' ``COMMANDS`` lists.

No command module imports the group: each lists its commands, and this is the one place
that puts them together. A new command module is one line in :data:`COMMAND_MODULES`.
"""

from __future__ import annotations

from importlib import import_module

import click

from .examples import add_examples
from .output import add_output_flags

__all__ = ["COMMAND_MODULES", "make_cli"]

# Modules of this package defining a ``COMMANDS`` list, in the order `--help` lists them.
COMMAND_MODULES = (
    "commands",
    "build_commands",
    "run_commands",
    "delta_commands",
    "release_commands",
    "serve_commands",
    "resign_commands",
    "adapter_commands",
    "update_commands",
    "tuf_client_commands",
    "export_commands",
    "bench_commands",
)


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from edgepack import __version__

    click.echo(f"edgepack, version {__version__}")
    ctx.exit()


def make_cli() -> click.Group:
    """The `edgepack` group with every command of :data:`COMMAND_MODULES` added."""

    @click.group(context_settings={"help_option_names": ["-h", "--help"]})
    @click.option(
        "--version",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_print_version,
        help="Show the version (edgepack.__version__) and exit.",
    )
    def cli() -> None:
        """edgepack: package, version and deliver on-device LLMs."""

    for name in COMMAND_MODULES:
        for command in import_module(f".{name}", __package__).COMMANDS:
            cli.add_command(command)
    add_output_flags(cli)
    add_examples(cli)
    return cli
