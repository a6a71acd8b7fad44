"""`edgepack build`, `edgepack eval` and `edgepack profile-device`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .options import (
    ACTIVATIONS_CHOICE,
    KV_CHOICE,
    json_option,
    kernels_option,
    kernels_or_none,
    kv_option,
    model_card_options,
    output_option,
    prefix_options,
    release_options,
    sign_key_option,
    threads_option,
)
from .output import record
from .pointers import SourcePath
from .progress import progress_bars

if TYPE_CHECKING:
    from edgepack.packager.prefix import PrefixRequest


@click.command()
@click.argument("src", type=SourcePath())
@output_option(
    "Package to write (.epk).",
    inputs=("src", "recipe", "lut", "calib", "eval_file", "card_file", "prefix_file"),
)
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False), help="TOML recipe.")
@click.option("--target-bpw", type=float, default=None, help="Bits per weight, whole file.")
@click.option("--target-size", type=int, default=None, help="Bytes of the whole file.")
@click.option("--latency-budget", type=float, default=None, help="Decode ms/token (needs a LUT).")
@click.option("--lut", type=click.Path(exists=True, dir_okay=False), help="profile-device output.")
@click.option(
    "--calib",
    type=click.Path(exists=True, dir_okay=False),
    help='Calibration text: a UTF-8 file (one document), or .jsonl/.ndjson with one document '
    'per line, {"text": "..."} or a JSON string. Default: the first 40 of Python\'s pydoc '
    'topics (sorted).',
)
@sign_key_option("the package")
@release_options
@model_card_options
@click.option("--no-report", is_flag=True, help="Skip OUT.report.md / .png / .json.")
@click.option(
    "--eval",
    "eval_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Held-out text: PPL, KL and top-1 of the package against the float model.",
)
@prefix_options
@click.option(
    "--adapter",
    "adapters",
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    help="PEFT LoRA folder to pack as a section bound to the built weights; repeatable.",
)
def build(
    src: str,
    out: str,
    recipe: str | None,
    target_bpw: float | None,
    target_size: int | None,
    latency_budget: float | None,
    lut: str | None,
    calib: str | None,
    sign_keys: tuple[str, ...],
    model_name: str | None,
    model_version: str,
    min_runtime_version: str | None,
    no_report: bool,
    eval_file: str | None,
    card: dict,
    prefixes: PrefixRequest | None,
    adapters: tuple[str, ...],
) -> None:
    """Calibrate, search a mixed-precision plan within budgets, quantize and package."""
    from edgepack.format import load_private_key
    from edgepack.packager.build import build as run_build
    from edgepack.packager.calibration import calibration_texts
    from edgepack.packager.profile_device import LatencyTable
    from edgepack.packager.recipe import load_recipe

    if target_bpw is not None and target_size is not None:
        raise click.UsageError("give --target-bpw or --target-size, not both")
    r = load_recipe(recipe).with_budget(target_bpw, target_size, latency_budget, lut)
    if r.search.latency_budget_ms and not r.search.lut:
        raise click.UsageError("--latency-budget needs a LUT (--lut or [search] lut)")
    keys = [load_private_key(k) for k in sign_keys]
    # bad input files fail here, not after minutes of importing and calibrating
    table = LatencyTable.load(r.search.lut) if r.search.lut else None
    if calib or r.calibration.file:
        calibration_texts(calib or r.calibration.file)
    with progress_bars() as bar:
        result = run_build(
            src,
            out,
            r,
            calib_file=calib,
            sign_keys=keys,
            progress=bar,
            report=not no_report,
            lut=table,
            model_name=model_name,
            model_version=model_version,
            min_runtime_version=min_runtime_version,
            eval_file=eval_file,
            card=card,
            prefixes=prefixes,
            adapters=adapters,
        )
    record(**result.to_json())
    for line in result.summary():
        click.echo(line)
    if result.report_path:
        click.echo(f"report {result.report_path}")


@click.command("eval")
@click.argument("package", type=click.Path(exists=True, dir_okay=False))
@click.option("--ref", type=click.Path(exists=True, dir_okay=False), help="Reference package.")
@click.option("--text", type=click.Path(exists=True, dir_okay=False), help="Default: held-out.")
@click.option(
    "--ctx", default=512, show_default=True, type=click.IntRange(min=4), help="Tokens per chunk."
)
@click.option(
    "--chunks", default=None, type=click.IntRange(min=1), help="At most this many chunks."
)
@kv_option
@click.option("--ref-kv", default=None, type=KV_CHOICE, help="The reference's KV (default: --kv).")
@click.option("--activations", default="auto", type=ACTIVATIONS_CHOICE, show_default=True)
@kernels_option
@threads_option
@click.option(
    "--ref-cache",
    type=click.Path(file_okay=False),
    help="Keep the reference's log-probs here (later runs skip the reference model).",
)
@json_option("the result")
def eval_command(
    package: str,
    ref: str | None,
    text: str | None,
    ctx: int,
    chunks: int | None,
    kv: str,
    ref_kv: str | None,
    activations: str,
    kernels: str,
    threads: int | None,
    ref_cache: str | None,
    as_json: bool,
) -> None:
    """Perplexity (llama.cpp protocol), and KL / top-1 agreement against --ref."""
    from edgepack.packager.evaluate import evaluate

    body = Path(text).read_text(encoding="utf-8") if text else None

    with progress_bars("PPL", unit="chunks") as bar:

        def tick(i: int, n: int, ppl: float) -> None:
            if bar.current is None:
                bar.start(n)
            bar.advance(1, f"PPL {ppl:.4f}")

        res = evaluate(
            package,
            body,
            ctx=ctx,
            chunks=chunks,
            ref=ref,
            kernels=kernels_or_none(kernels),
            activations=activations,
            kv=kv,
            ref_kv=ref_kv,
            threads=threads,
            on_chunk=tick,
            ref_cache=ref_cache,
        )
    if as_json:
        click.echo(json.dumps(res.to_json(), indent=2))
    else:
        for line in res.lines():
            click.echo(line)


@click.command("profile-device")
@output_option("Latency table to write (JSON, for build --lut).", inputs=("model",))
@click.option("--model", type=click.Path(exists=True, dir_okay=False), help="Shapes of this .epk.")
@kernels_option
@threads_option
@click.option(
    "--repeats", default=5, show_default=True, type=click.IntRange(1), help="Best-of timed calls."
)
def profile_device(
    out: str, model: str | None, kernels: str, threads: int | None, repeats: int
) -> None:
    """Microbenchmark the runtime's kernels per (shape, encoding) into a latency LUT."""
    from edgepack.packager.profile_device import profile

    kern = kernels_or_none(kernels)
    with progress_bars() as bar:
        table = profile(model=model, kernels=kern, threads=threads, repeats=repeats, progress=bar)
    table.save(out)
    record(path=out, entries=len(table.entries), kernels=table.kernels, threads=table.threads)
    click.echo(
        f"wrote {out}: {len(table.entries)} entries ({table.kernels}, {table.threads} threads)"
    )


COMMANDS = [build, eval_command, profile_device]
