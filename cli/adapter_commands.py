"""`edgepack pack-adapter` and `edgepack merge-lora`: LoRA adapters as small releases of
their own, or folded into the weights (:mod:`edgepack.packager.adapters`)."""

from __future__ import annotations

import click

from .options import output_option, semver_value, sign_key_option
from .output import record

_ADAPTER = click.Path(exists=True)
_ENCODINGS = click.Choice(["int8", "f16", "f32"])


@click.command("pack-adapter")
@click.argument("base", type=click.Path(exists=True, dir_okay=False))
@click.argument("adapter", type=_ADAPTER)
@output_option("Adapter-only package to write (.epk).", inputs=("base", "adapter"))
@click.option(
    "--adapter-encoding",
    default="int8",
    type=_ENCODINGS,
    show_default=True,
    help="Encoding of the A and B factors.",
)
@click.option(
    "--model-version",
    default=None,
    metavar="VERSION",
    callback=semver_value,
    help="Version of the adapter release (default: the base's; publishing needs a new one).",
)
@sign_key_option("the adapter package")
def pack_adapter(
    base: str,
    adapter: str,
    out: str,
    adapter_encoding: str,
    model_version: str | None,
    sign_keys: tuple[str, ...],
) -> None:
    """Package ADAPTER (a PEFT folder) for BASE.epk: a small package naming its base by
    the digest of its weights, refused by the runtime on any other."""
    from edgepack.format import load_private_key
    from edgepack.packager.adapters import pack_adapter as run
    from edgepack.packager.adapters import parse_adapter_encoding

    keys = [load_private_key(k) for k in sign_keys]
    path = run(
        base, adapter, out, encoding=parse_adapter_encoding(adapter_encoding),
        signing_keys=keys, overwrite=True, version=model_version,
    )  # fmt: skip
    record(path=str(path), size=path.stat().st_size, signed=bool(keys))
    click.echo(f"wrote {path}: {path.stat().st_size:,} bytes, adapter for {base}")


@click.command("merge-lora")
@click.argument("base", type=click.Path(exists=True, dir_okay=False))
@click.argument("adapter", type=_ADAPTER)
@output_option("Merged package to write (.epk).", inputs=("base", "adapter", "source"))
@click.option(
    "--source",
    type=click.Path(exists=True),
    default=None,
    help="The base's float weights (HF folder, safetensors, GGUF): merge into these.",
)
@sign_key_option("the merged package")
def merge_lora(
    base: str, adapter: str, out: str, source: str | None, sign_keys: tuple[str, ...]
) -> None:
    """Merge ADAPTER (a PEFT folder or an adapter package) into BASE.epk: each adapted
    tensor re-encoded in its own encoding, every other one kept as stored."""
    from edgepack.format import load_private_key
    from edgepack.packager.adapters_merge import merge_lora as run

    keys = [load_private_key(k) for k in sign_keys]
    result = run(base, adapter, out, source=source, signing_keys=keys, overwrite=True)
    record(
        path=str(result.path),
        merged=result.merged,
        dropped_adapters=result.dropped_adapters,
        from_source=result.from_source,
    )
    into = "the --source float weights" if result.from_source else "the dequantized base"
    click.echo(f"wrote {result.path}: {len(result.merged)} tensors merged into {into}")
    if result.dropped_adapters:
        stale = ", ".join(result.dropped_adapters)
        click.echo(f"dropped adapters bound to the old weights: {stale}")


COMMANDS = [pack_adapter, merge_lora]
