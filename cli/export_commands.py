"""`edgepack export`: a package as a GGUF file for llama.cpp, every value kept exactly.

A precision plan searched here (``build``) then runs in llama.cpp too, as long as its
encodings map onto GGUF types bit for bit (:mod:`edgepack.packager.export_gguf_tensors`).
"""

from __future__ import annotations

import inspect

import click

from .options import output_option
from .output import record


class _ExportCommand(click.Command):
    """Help that lists the exportable encodings from their one table, read only when
    help is shown (it imports gguf)."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from edgepack.packager.export_gguf_tensors import EXPORTABLE

        extra = f"Exportable: {EXPORTABLE}."
        if extra not in (self.help or ""):
            self.help = f"{inspect.cleandoc(self.help or '')}\n\n{extra}"
        super().format_help_text(ctx, formatter)


@click.command(cls=_ExportCommand)
@click.argument("package", type=click.Path(exists=True, dir_okay=False))
@output_option("GGUF file to write.", inputs=("package",))
def export(package: str, out: str) -> None:
    """Write PACKAGE as a GGUF file (llama.cpp's llama architecture).

    Every tensor keeps its values bit for bit; a package holding an encoding GGUF cannot
    store exactly is refused (exit 2), naming the tensor and its encoding.
    """
    from edgepack.packager.export_gguf import export_gguf

    report = export_gguf(package, out, overwrite=True)  # the option checked the target
    types = ", ".join(f"{n} {name}" for name, n in sorted(report.gguf_types.items()))
    record(
        path=out, tensors=report.tensors, gguf_types=report.gguf_types, size=report.bytes_written
    )
    click.echo(f"wrote {out}: {report.tensors} tensors ({types}), {report.bytes_written} bytes")


COMMANDS = [export]
