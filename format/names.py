"""Model and channel names: the one rule every layer checks them by.

A release store uses them as path segments (``targets/<model>/<channel>/...``), so they
stay plain. ``convert`` and ``build`` write a name that ``publish`` accepts: one given by
the user is checked here, one taken from a source (a GGUF's ``general.name``) is slugged.
"""

from __future__ import annotations

import re

__all__ = ["check_name", "slug_name"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MAX = 128


def check_name(kind: str, name: str) -> str:
    """``name`` if it is a valid ``kind`` name (model, channel); ValueError otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"{kind} name {name!r} must be 1-128 of letters, digits, '.', '_', '-' "
            "(starting with a letter or digit)"
        )
    return name


def slug_name(text: str, fallback: str = "model") -> str:
    """A valid name derived from free text: ``Smollm2 135M 8k`` -> ``smollm2-135m-8k``."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", text.lower())
    slug = re.sub(r"\.{2,}", ".", slug)
    slug = re.sub(r"-{2,}", "-", slug).strip("-._")[:_MAX].rstrip("-._")
    return slug or fallback
