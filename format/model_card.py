"""The model card a package carries: one METADATA_JSON section named ``model_card``
(spec/FORMAT.md section 5b), read by ``inspect``, the runtime and the release server.

The card is plain data: the fields below (UTF-8 strings, each optional) plus ``origin``,
which says where each field came from (``gguf general.license``, ``README.md``,
``--license``...). Readers ignore fields they do not know.
"""

from __future__ import annotations

import json
from typing import Any

from .constants import SectionKind

__all__ = ["CARD_FIELDS", "MODEL_CARD_SECTION", "read_model_card"]

MODEL_CARD_SECTION = "model_card"
CARD_FIELDS = ("license", "description", "intended_use", "source", "training_data")


def read_model_card(pkg: Any) -> dict[str, Any] | None:
    """The card of an open :class:`~edgepack.format.Package`, or None when it has none."""
    data = pkg.section(SectionKind.METADATA_JSON, name=MODEL_CARD_SECTION)
    return None if data is None else json.loads(data)
