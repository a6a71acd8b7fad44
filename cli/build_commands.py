"""`edgepack build`, `edgepack eval` and `edgepack profile-device`."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import click

from .commands import cli


class _RichProgress:
    """One rich progress bar per build phase, on stderr (silent without rich)."""

    def __init__(self, progress) -> None:
        self._p = progress
        self._task = None
        self._name = ""

    def phase(self, name: str, total: int) -> None:
        if self._p is None:
            return
        if self._task is not None:
            self._p.update(self._task, completed=self._p.tasks[-1].total, description=self._name)
        self._name = name
        self._task = self._p.add_task(name, total=max(total, 1))

    def advance(self, amount: int = 1, detail: str | None = None) -> None:
        if self._p is not None and self._task is not None:
            desc = f"{self._name} {detail}" if detail else self._name
            self._p.update(self._task, advance=amount, description=desc)

    def log(self, message: str) -> None:
        if self._p is not None:
            self._p.console.print(message)

    def finish(self) -> None:
        if self._p is not None and self._task is not None:
            self._p.update(self._task, completed=self._p.tasks[-1].total, description=self._name)


@contextmanager
def _progress():
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
    except ImportError:
        yield _RichProgress(None)
        return
    console = Console(stderr=True)
    columns = [
        TextColumn("{task.description:<56.56}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console) as p:
        bar = _RichProgress(p)
        yield bar
        bar.finish()


@cli.command()
@click.argument("src", type=click.Path(exists=True))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False))
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False), help="TOML recipe.")
@click.option("--target-bpw", type=float, default=None, help="Bits per weight, whole file.")
@click.option("--target-size", type=int, default=None, help="Bytes of the whole file.")
@click.option("--latency-budget", type=float, default=None, help="Decode ms/token (needs a LUT).")
@click.option("--lut", type=click.Path(exists=True, dir_okay=False), help="profile-device output.")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False), help="Text or JSONL.")
@click.option(
    "--sign-key",
    "sign_keys",
    multiple=True,
    type=click.Path(exists=True),
    help="Ed25519 private key (NAME.key); repeatable.",
)
@click.option("--no-report", is_flag=True, help="Skip OUT.report.md / .png.")
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
    no_report: bool,
) -> None:
    """Calibrate, search a mixed-precision plan within budgets, quantize and package."""
    from edgepack.format import load_private_key
    from edgepack.format.errors import EXIT_USAGE
    from edgepack.packager.build import build as run_build
    from edgepack.packager.recipe import load_recipe
    from edgepack.packager.search import SearchError

    if target_bpw is not None and target_size is not None:
        raise click.UsageError("give --target-bpw or --target-size, not both")
    r = load_recipe(recipe).with_budget(target_bpw, target_size, latency_budget, lut)
    if r.search.latency_budget_ms and not r.search.lut:
        raise click.UsageError("--latency-budget needs a LUT (--lut or [search] lut)")
    keys = [load_private_key(k) for k in sign_keys]
    try:
        with _progress() as bar:
            result = run_build(
                src, out, r, calib_file=calib, sign_keys=keys, progress=bar, report=not no_report
            )
    except SearchError as exc:  # an impossible budget is the caller's to change
        err = click.ClickException(str(exc))
        err.exit_code = EXIT_USAGE
        raise err from None
    for line in result.summary():
        click.echo(line)
    if result.report_path:
        click.echo(f"report {result.report_path}")


@cli.command("eval")
@click.argument("package", type=click.Path(exists=True, dir_okay=False))
@click.option("--ref", type=click.Path(exists=True, dir_okay=False), help="Reference package.")
@click.option("--text", type=click.Path(exists=True, dir_okay=False), help="Default: held-out.")
@click.option("--ctx", default=512, show_default=True, help="Tokens per chunk.")
@click.option("--chunks", default=None, type=int, help="At most this many chunks.")
@click.option("--kv", default="float", type=click.Choice(["float", "int8"]), show_default=True)
@click.option(
    "--activations", default="auto", type=click.Choice(["auto", "int8", "float"]), show_default=True
)
@click.option("--kernels", default=None, type=click.Choice(["auto", "numpy", "native"]))
@click.option("--threads", default=None, type=int)
@click.option(
    "--ref-cache",
    type=click.Path(file_okay=False),
    help="Keep the reference's log-probs here (later runs skip the reference model).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def eval_command(
    package: str,
    ref: str | None,
    text: str | None,
    ctx: int,
    chunks: int | None,
    kv: str,
    activations: str,
    kernels: str | None,
    threads: int | None,
    ref_cache: str | None,
    as_json: bool,
) -> None:
    """Perplexity (llama.cpp protocol), and KL / top-1 agreement against --ref."""
    from edgepack.packager.evaluate import evaluate

    body = Path(text).read_text(encoding="utf-8") if text else None
    kern = None if kernels in (None, "auto") else kernels

    def tick(i: int, n: int, ppl: float) -> None:
        print(f"\r[{i}/{n}] PPL {ppl:.4f}", end="", file=sys.stderr, flush=True)

    res = evaluate(
        package,
        body,
        ctx=ctx,
        chunks=chunks,
        ref=ref,
        kernels=kern,
        activations=activations,
        kv=kv,
        threads=threads,
        on_chunk=tick,
        ref_cache=ref_cache,
    )
    print(file=sys.stderr)
    if as_json:
        click.echo(json.dumps(res.to_json(), indent=2))
    else:
        for line in res.lines():
            click.echo(line)


@cli.command("profile-device")
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False))
@click.option("--model", type=click.Path(exists=True, dir_okay=False), help="Shapes of this .epk.")
@click.option("--kernels", default=None, type=click.Choice(["auto", "numpy", "native"]))
@click.option("--threads", default=None, type=int)
@click.option("--repeats", default=5, show_default=True, help="Timed calls per entry (best of).")
def profile_device(
    out: str, model: str | None, kernels: str | None, threads: int | None, repeats: int
) -> None:
    """Microbenchmark the runtime's kernels per (shape, encoding) into a latency LUT."""
    from edgepack.packager.profile_device import profile

    kern = None if kernels in (None, "auto") else kernels
    with _progress() as bar:
        table = profile(model=model, kernels=kern, threads=threads, repeats=repeats, progress=bar)
    table.save(out)
    click.echo(
        f"wrote {out}: {len(table.entries)} entries ({table.kernels}, {table.threads} threads)"
    )
