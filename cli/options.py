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
    "endpoint_option",
    "json_option",
    "kernels_option",
    "kernels_or_none",
    "kv_default",
    "output_option",
    "sign_key_option",
    "store_option",
    "threads_option",
    "threshold_option",
    "trusted_key_option",
]

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

KERNEL_CHOICES = ("auto", "numpy", "native")


class _KVChoice(click.Choice):
    """The KV cache layouts of ``runtime_shim.kv_cache.KV_LAYOUTS`` (their one table),
    read on first use so the CLI starts without importing the runtime."""

    def __init__(self) -> None:
        super().__init__(())

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        from edgepack.runtime_shim.kv_cache import KV_MODES

        return KV_MODES

    @choices.setter
    def choices(self, value: object) -> None:  # click's __init__ assigns; the table rules
        pass


KV_CHOICE = _KVChoice()  # KV cache storage


def kv_default() -> str:
    """The runtime's default KV layout (``runtime_shim.kv_cache.DEFAULT_KV``), read lazily."""
    from edgepack.runtime_shim.kv_cache import DEFAULT_KV

    return DEFAULT_KV
ACTIVATIONS_CHOICE = click.Choice(["auto", "int8", "float"])  # matmul inputs

_KEY_FILE = click.Path(exists=True, dir_okay=False)


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



def json_option(what: str) -> Decorator:
    """``--json`` flag, passed as ``as_json``."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as JSON.")


def kernels_or_none(kernels: str) -> str | None:
    """The runtime's ``kernels=`` argument: None lets it choose (``auto``)."""
    return None if kernels == "auto" else kernels
