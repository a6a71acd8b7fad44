"""Options several commands share, declared once so their names, types and defaults agree.

Each is a decorator (or a factory of one when the help names what the command does with
it). Parameter names are part of the contract: commands receive ``out``, ``sign_keys``,
``trusted_keys``, ``threshold``, ``require_signature``, ``kernels``, ``threads`` and ``as_json``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import click

__all__ = [
    "ACTIVATIONS_CHOICE",
    "KERNEL_CHOICES",
    "KV_CHOICE",
    "LazyHelpOption",
    "endpoint_option",
    "force_option",
    "json_flag",
    "json_option",
    "json_requested",
    "kernels_option",
    "kernels_or_none",
    "kv_default",
    "kv_option",
    "model_card_options",
    "model_name_value",
    "output_option",
    "release_options",
    "require_signature_option",
    "semver_value",
    "sign_key_option",
    "signature_facts",
    "signature_summary",
    "store_option",
    "threads_option",
    "threshold_option",
    "trusted_key_option",
    "unchecked_warning",
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


class _KVOption(click.Option):
    """``--kv`` with the runtime's default, read (and shown in ``--help``) lazily."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        self.default = kv_default()
        return super().get_help_record(ctx)


kv_option: Decorator = click.option(
    "--kv",
    cls=_KVOption,
    default=kv_default,
    show_default=True,
    type=KV_CHOICE,
    help="KV cache layout (the runtime's default is what devices run).",
)
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


def output_option(help: str, inputs: tuple[str, ...] = ()) -> Decorator:
    """``-o/--output FILE`` (required, passed as ``out``) and ``--force``.

    Before the command runs, the output is checked by
    :func:`edgepack.format.output_file.check_output_path`: it must not be one of the
    parameters named in ``inputs`` (under any spelling), must not exist unless
    ``--force``, and must be a regular file in an existing directory."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def checked(*args: Any, force: bool, **kwargs: Any) -> Any:
            from edgepack.format.output_file import check_output_path

            given = [kwargs[name] for name in inputs if kwargs.get(name) is not None]
            check_output_path(kwargs["out"], given, overwrite=force)
            return command(*args, **kwargs)

        checked = force_option(checked)
        return click.option(
            "-o", "--output", "out", required=True, type=click.Path(dir_okay=False), help=help
        )(checked)

    return decorate


force_option: Decorator = click.option(
    "--force", is_flag=True, help="Replace the output if it exists (never an input)."
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
    metavar="STORE",
    envvar="EDGEPACK_STORE",
    help="Release store: a directory, file:///path or s3://bucket/prefix ($EDGEPACK_STORE).",
)

endpoint_option: Decorator = click.option(
    "--endpoint-url",
    default=None,
    metavar="URL",
    help="S3-compatible endpoint (default: AWS_ENDPOINT_URL / AWS config).",
)

threshold_option: Decorator = click.option(
    "--threshold",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Signatures from distinct trusted keys required (at least 1).",
)

require_signature_option: Decorator = click.option(
    "--require-signature",
    is_flag=True,
    help="Fail (exit 4) unless a --trusted-key signature is checked: for release pipelines.",
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
                metavar="NAME",
                callback=model_name_value,
                help="Model name publish files it under (default: the source's name, "
                "slugged: 'Smollm2 135M' -> smollm2-135m).",
            ),
            click.option(
                "--model-version",
                default="1.0.0",
                metavar="VERSION",
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



# Set by ``--json`` as soon as it is parsed (eager), so the entry point prints a failure
# as a JSON error object too, even one raised while parsing the other options.
json_requested: ContextVar[bool] = ContextVar("json_requested", default=False)


def _note_json(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        json_requested.set(True)
    return value


def json_option(what: str) -> Decorator:
    """``--json`` flag, passed as ``as_json``; on failure the command prints
    ``{"error": {"type", "message", "exit_code"}}`` on stdout (see :func:`edgepack.cli.main`)."""
    return click.option("--json", "as_json", **_json_settings(what))


def json_flag(what: str) -> click.Option:
    """The :func:`json_option` flag as an option object, for commands built elsewhere
    (:func:`edgepack.cli.output.add_output_flags`)."""
    return click.Option(["--json", "as_json"], **_json_settings(what))


def _json_settings(what: str) -> dict[str, Any]:
    return {
        "is_flag": True,
        "is_eager": True,
        "callback": _note_json,
        "help": f"Print {what} as JSON (errors too).",
    }


def unchecked_warning(what: str, keys: object, require_signature: bool) -> str | None:
    """With no trusted key: the one warning line to print once the command succeeded,
    or (``--require-signature``) the signature error (exit 4), raised before any work."""
    if keys:
        return None
    from edgepack.format.signing import unchecked_signature_warning

    return unchecked_signature_warning(what, require_signature=require_signature)


def signature_summary(report: object) -> str:
    """How a verified file was signed, in the words `verify` and `patch` both print
    (``report`` is a VerifyReport or a patch report: ``trusted_signers``, ``signed``)."""
    signers = getattr(report, "trusted_signers", ())
    if signers:
        return "signed by trusted key(s) " + ", ".join(s[:16] for s in signers)
    if getattr(report, "signed", False):
        return "signed, signature not checked (no --trusted-key given)"
    return "unsigned"


def signature_facts(report: object) -> dict[str, Any]:
    """:func:`signature_summary` as ``--json`` facts."""
    return {
        "trusted_signers": list(getattr(report, "trusted_signers", ())),
        "signed": bool(getattr(report, "signed", False)),
    }


def kernels_or_none(kernels: str) -> str | None:
    """The runtime's ``kernels=`` argument: None lets it choose (``auto``)."""
    return None if kernels == "auto" else kernels


def prefix_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--prefix-file`` and ``--prefix-system``, passed as ``prefixes`` (a
    :class:`~edgepack.packager.prefix.PrefixRequest` or None)."""

    @functools.wraps(command)
    def wrapped(*args: Any, prefix_file: str | None, prefix_system: bool, **kwargs: Any) -> Any:
        from edgepack.packager.prefix import PrefixRequest, read_prefix_file

        if prefix_system and not prefix_file:
            raise click.UsageError("--prefix-system needs --prefix-file")
        texts = tuple(read_prefix_file(prefix_file)) if prefix_file else ()
        prefixes = PrefixRequest(texts, prefix_system) if texts else None
        return command(*args, prefixes=prefixes, **kwargs)

    wrapped = click.option(
        "--prefix-system", is_flag=True, help="Each prefix is a system prompt (chat template)."
    )(wrapped)
    return click.option(
        "--prefix-file",
        type=click.Path(exists=True, dir_okay=False),
        help="Store KV caches for these prefixes: a JSON list of strings or one per line.",
    )(wrapped)
def model_card_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--license``, ``--description``, ``--intended-use``, ``--card FILE.json|md``: the
    model card's fields, over what the source states; passed as one ``card`` (field ->
    (value, origin), :func:`edgepack.packager.model_card.card_overrides`), read before the
    command's work so a bad card file fails first."""

    @functools.wraps(func)
    def collected(
        *args: Any,
        license: str | None,
        description: str | None,
        intended_use: str | None,
        card_file: str | None,
        **kwargs: Any,
    ) -> Any:
        from edgepack.packager.model_card import card_overrides

        card = card_overrides(
            card_file, license=license, description=description, intended_use=intended_use
        )
        return func(*args, card=card, **kwargs)

    for option in reversed(
        (
            click.option("--license", default=None, help="Model card: license (SPDX id)."),
            click.option("--description", default=None, help="Model card: what the model is."),
            click.option("--intended-use", default=None, help="Model card: what it is for."),
            click.option(
                "--card",
                "card_file",
                type=click.Path(exists=True, dir_okay=False),
                help="Model card file: JSON object of its fields, or Markdown with YAML "
                "front matter (flags override it; it overrides the source's metadata).",
            ),
        )
    ):
        collected = option(collected)
    return collected
