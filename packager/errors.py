"""Errors of the packager, typed by what the caller can do about them.

Both kinds extend :class:`edgepack.format.errors.EdgepackError`, so the CLI maps them to
exit codes in its one table (:mod:`edgepack.cli.exit_codes`):

* :class:`ImportModelError` - the source model's bytes cannot be read or understood
  (corrupt or unsupported): get another file.
* :class:`InputError` and its subclasses - something the caller chose is unusable
  (a recipe, a calibration file, a latency table, a budget, a source of the wrong kind,
  an evaluation text too short, a package GGUF cannot hold exactly): change the argument.
  Each message names the input and what to change.
"""

from __future__ import annotations

from edgepack.format.errors import EdgepackError

__all__ = [
    "CalibrationError",
    "ImportModelError",
    "InputError",
    "LatencyTableError",
    "QuantizedSourceError",
    "RecipeError",
    "SearchError",
    "UnexportableError",
]


class ImportModelError(EdgepackError):
    """A source model (safetensors, GGUF, HF directory) cannot be read or understood."""


class InputError(EdgepackError):
    """An input the caller chose cannot be used as given (a usage error)."""


class RecipeError(InputError):
    """The recipe is malformed or asks for something impossible."""


class CalibrationError(InputError):
    """The calibration text cannot be used: a malformed JSONL line, no documents, or a
    source model without the tokenizer calibration needs."""


class LatencyTableError(InputError):
    """The latency LUT file is unreadable or not one `edgepack profile-device` wrote."""


class QuantizedSourceError(InputError):
    """``build`` was given an already quantized package; it needs a float model."""


class SearchError(InputError):
    """No assignment meets the budgets (the message says the smallest possible)."""


class UnexportableError(InputError):
    """``export`` was given a package GGUF cannot hold exactly: a tensor encoding with no
    bit-identical GGUF type, or a model or tokenizer llama.cpp's format cannot describe."""
