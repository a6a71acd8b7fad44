"""`edgepack diff` and `edgepack patch`: tensor-aware deltas between packages (spec/DELTA.md).

Errors are the typed ones of edgepack.format.delta.errors, mapped to exit codes by the
CLI entry point: 3 corrupt delta, wrong base or mismatching result, 4 signature,
5 a delta format this edgepack cannot read.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from .exit_codes import EXIT_OK
from .options import (
    output_option,
    require_signature_option,
    sign_key_option,
    signature_facts,
    signature_summary,
    threshold_option,
    trusted_key_option,
    unchecked_warning,
)
from .output import record
from .progress import progress_bars


@click.command()
@click.argument("old", type=click.Path(exists=True, dir_okay=False))
@click.argument("new", type=click.Path(exists=True, dir_okay=False))
@output_option("Delta to write (.epkd).", inputs=("old", "new"))
@sign_key_option("the delta")
@click.option(
    "--level",
    default=19,
    show_default=True,
    type=click.IntRange(1, 22),
    help="zstd level of the streams.",
)
@click.option("--no-verify", is_flag=True, help="Skip applying the delta once before writing it.")
def diff(
    old: str, new: str, out: str, sign_keys: tuple[str, ...], level: int, no_verify: bool
) -> int:
    """Write a delta that turns package OLD into package NEW."""
    from edgepack.format import load_private_key
    from edgepack.server.delta import DeltaOptions, create_delta

    keys = [load_private_key(k) for k in sign_keys]
    start = time.perf_counter()
    steps = ["plan tensors", "code and write" + ("" if no_verify else ", verify")]
    with progress_bars(phases=steps) as bar:
        bar.phase(steps[0], 0)
        stats = create_delta(
            old,
            new,
            out,
            signing_keys=keys,
            options=DeltaOptions(level=level, verify=not no_verify),
            progress=lambda done: bar.phase(steps[1], 0),  # called once: "planned"
        )
    seconds = time.perf_counter() - start
    new_size = Path(new).stat().st_size
    record(
        path=out,
        size=stats.size,
        new_size=new_size,
        ops=stats.ops,
        copied_bytes=stats.copied,
        coded_bytes=stats.coded,
        seconds=seconds,
        signatures=len(keys),
    )
    click.echo(
        f"wrote {out}: {stats.size:,} bytes ({100 * stats.size / max(new_size, 1):.2f}% of NEW), "
        f"{stats.ops} ops, {stats.copied:,} bytes copied, {stats.coded:,} coded, "
        f"{seconds:.1f} s" + (f", signed by {len(keys)} key(s)" if keys else ", unsigned")
    )
    return EXIT_OK


@click.command()
@click.argument("old", type=click.Path(exists=True, dir_okay=False))
@click.argument("delta", type=click.Path(exists=True, dir_okay=False))
@output_option("Package to write.", inputs=("old", "delta"))
@trusted_key_option("Public key (NAME.pub) the delta must be signed by; repeatable.")
@threshold_option
@require_signature_option
def patch(
    old: str,
    delta: str,
    out: str,
    trusted_keys: tuple[str, ...],
    threshold: int,
    require_signature: bool,
) -> int:
    """Apply DELTA to package OLD, writing the verified result atomically to -o."""
    from edgepack.format import load_public_key
    from edgepack.format.delta import DeltaFile, apply_delta

    keys = [load_public_key(k) for k in trusted_keys] or None
    warning = unchecked_warning(delta, keys, require_signature)
    start = time.perf_counter()
    with DeltaFile.open(delta) as d:
        target_size = d.header.target_file_size
    with progress_bars("patching", counting="bytes") as bar:
        bar.start(target_size)
        report = apply_delta(
            old, delta, out, trusted_keys=keys, threshold=threshold, progress=bar.advance
        )
    seconds = time.perf_counter() - start
    sig = signature_summary(report)
    record(
        path=out,
        size=report.target_size,
        seconds=seconds,
        **signature_facts(report),
    )
    click.echo(
        f"wrote {out}: {report.target_size:,} bytes, verified (SHA-256) in {seconds:.1f} s; {sig}"
    )
    if warning:
        click.echo(warning, err=True)
    return EXIT_OK


COMMANDS = [diff, patch]
