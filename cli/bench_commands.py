"""`edgepack bench`: prompt and generation speed in llama-bench's shape.

Same options (``-p 512 -n 128 -r 5``), the same table (model | size | params | backend |
threads | test | t/s, mean ± stddev) and, with ``--json``, records with llama-bench's
field names (``{"records": [...]}``: what ``llama-bench -o json`` prints, in the object
every command's ``--json`` prints), so the two tools' figures can be put side by side. The
measurements are :mod:`edgepack.runtime_shim.speed`.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import click

from .options import json_option, kernels_option, kernels_or_none, threads_option
from .output import json_text, log_to_stderr

_COLUMNS = ("model", "size", "params", "backend", "threads", "test", "t/s")
_RIGHT = {"size", "params", "threads", "test", "t/s"}  # aligned as llama-bench aligns them


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 10**9 else f"{n / 1e6:.2f} M"


def _param_count(header: Any) -> int:
    """Elements of the model's tensors (a low-rank tensor counts as its logical shape)."""
    factors = {f for t in header.tensors for f in t.factors}
    return sum(math.prod(t.shape) for t in header.tensors if t.name not in factors)


def _table(rows: list[dict[str, str]]) -> str:
    """A markdown table like llama-bench's."""
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in _COLUMNS}

    def line(cells: dict[str, str]) -> str:
        parts = [cells[c].rjust(widths[c]) if c in _RIGHT else cells[c].ljust(widths[c])
                 for c in _COLUMNS]
        return "| " + " | ".join(parts) + " |"

    rule = "| " + " | ".join(
        "-" * (widths[c] - 1) + ":" if c in _RIGHT else "-" * widths[c] for c in _COLUMNS
    ) + " |"
    return "\n".join([line({c: c for c in _COLUMNS}), rule, *(line(r) for r in rows)])


def _count(short: str, name: str, default: int, help: str, least: int = 0) -> Any:
    """A count option with llama-bench's flag and default."""
    kind = click.IntRange(min=least)
    return click.option(short, name, default=default, show_default=True, type=kind, help=help)


@click.command()
@click.argument("package", type=click.Path(exists=True, dir_okay=False))
@_count("-p", "--n-prompt", 512, "Prompt tokens of the prefill test (pp); 0 skips it.")
@_count("-n", "--n-gen", 128, "Tokens of the generation test (tg); 0 skips it.")
@_count("-r", "--repetitions", 5, "Timed runs of each test (after one warm-up run).", least=1)
@threads_option
@kernels_option
@json_option('{"records": [...]}, one record per test with llama-bench\'s field names')
def bench(
    package: str,
    n_prompt: int,
    n_gen: int,
    repetitions: int,
    threads: int | None,
    kernels: str,
    as_json: bool,
) -> None:
    """Measure PACKAGE's prefill (pp) and generation (tg) speed in tokens/s."""
    from edgepack import runtime_shim
    from edgepack.runtime_shim.speed import measure

    if n_prompt == 0 and n_gen == 0:
        raise click.UsageError("nothing to measure: -p and -n are both 0")
    log_to_stderr(logging.Formatter("%(message)s"), logging.WARNING)  # the runtime's warnings
    model = runtime_shim.open(package, threads=threads, kernels=kernels_or_none(kernels))
    with model:
        header = model.package.header
        size = os.path.getsize(package)
        params = _param_count(header)
        backend = model.kernel_path
        n_threads = model.kernels.threads
        tests = measure(model, n_prompt, n_gen, repetitions)
    name = header.identity.name
    records = [
        {
            "model_filename": package,
            "model_type": name,
            "model_size": size,
            "model_n_params": params,
            "backend": backend,
            "n_threads": n_threads,
            "n_prompt": t.n_prompt,
            "n_gen": t.n_gen,
            "test": t.name,
            "repetitions": repetitions,
            "avg_ts": t.mean,
            "stddev_ts": t.stddev,
            "samples_ts": list(t.samples),
        }
        for t in tests
    ]
    if as_json:  # an object, as every command's: {"error": ...} is then told apart by key
        click.echo(json_text({"records": records}))
        return
    rows = [
        {
            "model": name,
            "size": _size(size),
            "params": _params(params),
            "backend": backend,
            "threads": str(n_threads),
            "test": t.name,
            "t/s": f"{t.mean:.2f} ± {t.stddev:.2f}",
        }
        for t in tests
    ]
    click.echo(_table(rows))


COMMANDS = [bench]
