"""Path arguments that point a user who gave the wrong kind of input to the right command.

A GGUF file given where a package is read (``run``) is a file of another tool: the
message names ``convert``/``build``. A model hub id given where a local source is read
(``convert``, ``build``) is not a path at all, and edgepack never downloads from a hub:
the message says how to get the files.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

__all__ = ["GGUF_MAGIC", "PackagePath", "SourcePath", "looks_like_hub_id"]

GGUF_MAGIC = b"GGUF"
_HUB_ID = re.compile(r"(?:hf://|https?://huggingface\.co/)?([A-Za-z0-9][\w.-]*/[\w.-]+)/?")


def looks_like_hub_id(value: str) -> str | None:
    """``owner/name`` when ``value`` reads as a hub model id (or its URL), else None."""
    m = _HUB_ID.fullmatch(value)
    return m.group(1) if m and not value.startswith(("./", "../")) else None


class SourcePath(click.Path):
    """An existing file or folder; a hub id gets the way to fetch it instead of
    "does not exist"."""

    def __init__(self) -> None:
        super().__init__(exists=True)

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> Any:
        hub_id = looks_like_hub_id(str(value)) if not Path(str(value)).exists() else None
        if hub_id is not None:
            local = hub_id.split("/")[-1]
            self.fail(
                f"{value!r} does not exist here; if it is a model hub id: edgepack reads "
                "local files and never downloads from a hub. Fetch it first "
                f"(huggingface-cli download {hub_id} --local-dir {local}) and give the "
                f"folder ({local}), or try "
                "`edgepack fetch-sample smollm2`.",
                param,
                ctx,
            )
        return super().convert(value, param, ctx)


class PackagePath(click.Path):
    """An existing package file; a GGUF file gets the command that makes a package."""

    def __init__(self) -> None:
        super().__init__(exists=True, dir_okay=False)

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> Any:
        path = super().convert(value, param, ctx)
        try:
            with open(path, "rb") as f:
                magic = f.read(len(GGUF_MAGIC))
        except OSError:
            return path  # the command's own open reports it
        if magic == GGUF_MAGIC:
            stem = Path(str(path)).stem
            self.fail(
                f"{path} is a GGUF file, not an edgepack package: make one with "
                f"`edgepack convert {path} -o {stem}.epk` (one encoding) or "
                f"`edgepack build {path} -o {stem}.epk` (a searched mixed-precision plan).",
                param,
                ctx,
            )
        return path
