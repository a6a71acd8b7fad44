"""Options several commands share, declared once so their names, types and defaults agree.

Each is a decorator (or a factory of one when the help names what the command does with
it). Parameter names are part of the contract: commands receive ``out``, ``sign_keys``,
``trusted_keys``, ``threshold``, ``kernels``, ``threads`` and ``as_json``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

__all__ = [
    "ACTIVATIONS_CHOICE",
    "KERNEL_CHOICES",
    "KV_CHOICE",
    "LazyHelpOption",
    "endpoint_option",
    "json_option",
    "kernels_option",
    "kernels_or_none",
    "model_name_value",
    "output_option",
    "release_options",
    "semver_value",
    "sign_key_option",
    "store_option",
    "threads_option",
    "threshold_option",
    "trusted_key_option",
]

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

KERNEL_CHOICES = ("auto", "numpy", "native")
KV_CHOICE = click.Choice(["int8", "float"])  # KV cache storage
ACTIVATIONS_CHOICE = click.Choice(["auto", "int8", "float"])  # matmul inputs

_KEY_FILE = click.Path(exists=True, dir_okay=False)


class LazyHelpOption(click.Option):
    """An option whose help is computed only when help is shown (``help_text``, a
    function): help read from a registry must not make every command import it."""

    def __init__(self, *args: Any, help_text: Callable[[], str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._help_text = help_text

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        self.help = self._help_text()
        return super().get_help_record(ctx)


def output_option(help: str) -> Decorator:
    """``-o/--output FILE`` (required), passed as ``out``."""
    return click.option(
        "-o", "--output", "out", required=True, type=click.Path(dir_okay=False), help=help
    )


def sign_key_option(what: str) -> Decorator:
    """``--sign-key NAME.key``, repeatable, passed as ``sign_keys``."""
    return click.option(
        "--sign-key",
        "sign_keys",
        multiple=True,
        type=_KEY_FILE,
        help=f"Ed25519 private key (NAME.key) to sign {what} with; repeatable.",
    )


def trusted_key_option(help: str) -> Decorator:
    """``--trusted-key NAME.pub``, repeatable, passed as ``trusted_keys``."""
    return click.option("--trusted-key", "trusted_keys", multiple=True, type=_KEY_FILE, help=help)


store_option: Decorator = click.option(
    "--store",
    "store_url",
    required=True,
    envvar="EDGEPACK_STORE",
    help="Release store: a directory, file:///path or s3://bucket/prefix ($EDGEPACK_STORE).",
)

endpoint_option: Decorator = click.option(
    "--endpoint-url",
    default=None,
    help="S3-compatible endpoint (default: AWS_ENDPOINT_URL / AWS config).",
)

threshold_option: Decorator = click.option(
    "--threshold",
    default=1,
    show_default=True,
    help="Signatures from distinct trusted keys required.",
)

kernels_option: Decorator = click.option(
    "--kernels",
    default="auto",
    type=click.Choice(KERNEL_CHOICES),
    show_default=True,
    help="Kernel backend (auto: native where built, else numpy).",
)

threads_option: Decorator = click.option(
    "--threads", default=None, type=int, help="Kernel threads (default: all CPUs)."
)


def semver_value(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Click callback: a semantic version or a usage error."""
    from edgepack.format import parse_semver

    if value is not None:
        try:
            parse_semver(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def model_name_value(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> str | None:
    """Click callback: a model name ``publish`` accepts, or a usage error."""
    from edgepack.format.names import check_name

    if value is not None:
        try:
            check_name("model", value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def release_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--model-name``, ``--model-version``, ``--min-runtime-version`` (what a package
    says about its release), passed as ``model_name``, ``model_version``,
    ``min_runtime_version``; checked by the rules ``publish`` applies."""
    for option in reversed(
        (
            click.option(
                "--model-name",
                default=None,
                callback=model_name_value,
                help="Model name publish files it under (default: the source's name, "
                "slugged: 'Smollm2 135M' -> smollm2-135m).",
            ),
            click.option(
                "--model-version",
                default="1.0.0",
                show_default=True,
                callback=semver_value,
                help="Semantic version of this model release.",
            ),
            click.option(
                "--min-runtime-version",
                default=None,
                callback=semver_value,
                help="Oldest runtime allowed to load the package (default: this edgepack).",
            ),
        )
    ):
        func = option(func)
    return func



def json_option(what: str) -> Decorator:
    """``--json`` flag, passed as ``as_json``."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as JSON.")


def kernels_or_none(kernels: str) -> str | None:
    """The runtime's ``kernels=`` argument: None lets it choose (``auto``)."""
    return None if kernels == "auto" else kernels
