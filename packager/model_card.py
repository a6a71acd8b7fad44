"""The model card ``convert`` and ``build`` put in a package (the section and its fields:
:mod:`edgepack.format.model_card`).

Each field comes from, in order of precedence: a flag (``--license``, ``--description``,
``--intended-use``), a card file (``--card FILE.json`` with the card's fields, or
``FILE.md``: YAML front matter plus a body), the source's own metadata (a GGUF's
``general.*`` keys; the YAML front matter and text of a Hugging Face ``README.md``
beside a safetensors model; a float package's card). ``origin`` records where each
field came from, so a reader can tell the author's word from the tool's guess.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from edgepack.format import SectionKind
from edgepack.format.model_card import CARD_FIELDS, MODEL_CARD_SECTION

from .errors import InputError

__all__ = [
    "Fields",
    "ModelCardError",
    "card_from_json",
    "card_overrides",
    "card_section",
    "merge_card",
    "read_card_markdown",
    "source_card",
]

Fields = dict[str, tuple[str, str]]  # field -> (value, where it came from)

_MAX_TEXT = 2000  # characters of a README paragraph kept as a field


class ModelCardError(InputError):
    """A ``--card`` file cannot be read or holds something that is not a card."""


# GGUF ``general.*`` keys (gguf-py's Keys.General) per card field, first present wins
_GGUF_KEYS = {
    "license": ("general.license", "general.license.name"),
    "description": ("general.description",),
    "source": (
        "general.source.url",
        "general.source.repo_url",
        "general.source.huggingface.repository",
        "general.base_model.0.repo_url",
        "general.base_model.0.name",
        "general.repo_url",
        "general.url",
        "general.organization",  # who published it, when no address is given
    ),
    "training_data": ("general.datasets", "general.dataset.0.name"),
}

# README front-matter keys per card field (HF model-card metadata, and the card's own)
_FRONT_MATTER_KEYS = {
    "license": ("license", "license_name"),
    "description": ("description",),
    "intended_use": ("intended_use", "intended use"),
    "source": ("source", "base_model"),
    "training_data": ("training_data", "datasets"),
}
_HEADINGS = {  # README body sections that hold a field when the front matter does not
    "description": re.compile(r"model (summary|description|details)|^description$", re.I),
    "intended_use": re.compile(r"intended use|^uses?$|^usage$", re.I),
    "training_data": re.compile(r"training data", re.I),
}


def _text(value: Any) -> str | None:
    """A field's text: strings as they are, lists joined, anything else refused."""
    if isinstance(value, str):
        return value.strip() or None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return ", ".join(v.strip() for v in value if v.strip()) or None
    return None


def _first_keys(
    meta: Mapping[str, Any], table: Mapping[str, tuple[str, ...]], origin: str
) -> Fields:
    """Per field, the first of its keys in ``meta`` that holds text."""
    out: Fields = {}
    for name, keys in table.items():
        for key in keys:
            text = _text(meta.get(key))
            if text:
                out[name] = (text, f"{origin} {key}")
                break
    return out


def _split_front_matter(text: str) -> tuple[str | None, str]:
    m = re.match(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|\Z)", text, re.S)
    return (m.group(1), text[m.end() :]) if m else (None, text)


def _paragraphs_under(body: str) -> dict[str, str]:
    """Field -> the first paragraph of prose under a heading that names it."""
    out: dict[str, str] = {}
    heading = None
    para: list[str] = []

    def flush() -> None:
        for name, pattern in _HEADINGS.items():
            if heading is not None and para and name not in out and pattern.search(heading):
                out[name] = " ".join(para)[:_MAX_TEXT]

    for line in [*body.splitlines(), ""]:
        s = line.strip()
        if s.startswith("#"):
            flush()
            heading, para = s.lstrip("#").strip(), []
        elif not s or s.startswith(("|", "<", "!", "```", "-", "*")):
            flush()
            if para:
                heading = None  # one paragraph per heading
            para = []
        else:
            para.append(s)
    return out


def read_card_markdown(text: str, origin: str) -> Fields:
    """The card fields of a Markdown model card (a Hugging Face README or ``--card
    FILE.md``): YAML front matter first, else the first paragraph under a heading that
    names the field."""
    import yaml

    front, body = _split_front_matter(text)
    meta: Any = {}
    if front is not None:
        try:
            meta = yaml.safe_load(front) or {}
        except yaml.YAMLError as exc:
            raise ModelCardError(f"{origin}: front matter is not valid YAML: {exc}") from None
    if not isinstance(meta, dict):
        raise ModelCardError(f"{origin}: front matter must be a mapping")
    out = _first_keys(meta, _FRONT_MATTER_KEYS, f"{origin} front matter")
    for name, paragraph in _paragraphs_under(body).items():
        out.setdefault(name, (paragraph, f"{origin} section"))
    return out


def source_card(
    source_files: Iterable[Path], source_config: Mapping[str, Any] | None
) -> Fields:
    """The fields a source model states itself: a GGUF's metadata (its ``source_config``),
    or the README.md beside a safetensors model's files."""
    files = list(source_files)
    if source_config and any(str(k).startswith("general.") for k in source_config):
        return _first_keys(source_config, _GGUF_KEYS, "gguf")
    for folder in dict.fromkeys(p.parent for p in files):
        readme = folder / "README.md"
        if readme.is_file():
            return read_card_markdown(readme.read_text(encoding="utf-8", errors="replace"),
                                      "README.md")
    return {}


def card_overrides(
    card_file: str | Path | None = None,
    *,
    license: str | None = None,
    description: str | None = None,
    intended_use: str | None = None,
) -> Fields:
    """The fields the user gave: a card file, then the flags over it."""
    out: Fields = _read_card_file(Path(card_file)) if card_file else {}
    flags = {"license": license, "description": description, "intended_use": intended_use}
    for name, value in flags.items():
        text = _text(value)
        if text:
            out[name] = (text, f"--{name.replace('_', '-')}")
    return out


def _read_card_file(path: Path) -> Fields:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelCardError(f"cannot read card {path}: {exc}") from None
    if path.suffix.lower() in (".md", ".markdown"):
        return read_card_markdown(text, path.name)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelCardError(f"{path.name}: not JSON ({exc}); give a .json or .md card") from None
    if not isinstance(doc, dict):
        raise ModelCardError(f"{path.name}: a card is a JSON object of {', '.join(CARD_FIELDS)}")
    unknown = sorted(set(doc) - set(CARD_FIELDS) - {"origin"})
    if unknown:
        raise ModelCardError(
            f"{path.name}: unknown card field(s) {', '.join(unknown)} "
            f"(fields: {', '.join(CARD_FIELDS)})"
        )
    out: Fields = {}
    for name in CARD_FIELDS:
        if name in doc:
            text_value = _text(doc[name])
            if text_value is None:
                raise ModelCardError(f"{path.name}: {name} must be a string")
            out[name] = (text_value, path.name)
    return out


def merge_card(base: Fields, overrides: Fields) -> Fields:
    """``overrides`` (the user's) over ``base`` (the source's)."""
    return {**base, **overrides}


def card_from_json(doc: Mapping[str, Any] | None) -> Fields:
    """The fields of a stored card (a float package's, used as a build source)."""
    if not doc:
        return {}
    origin = doc.get("origin") if isinstance(doc.get("origin"), dict) else {}
    return {
        name: (str(doc[name]), str(origin.get(name, "source package")))
        for name in CARD_FIELDS
        if _text(doc.get(name))
    }


def card_section(fields: Fields) -> tuple[SectionKind, bytes, str, str] | None:
    """The METADATA_JSON section holding the card, or None when no field is known."""
    if not fields:
        return None
    doc: dict[str, Any] = {name: fields[name][0] for name in CARD_FIELDS if name in fields}
    doc["origin"] = {name: fields[name][1] for name in CARD_FIELDS if name in fields}
    data = json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()
    return (SectionKind.METADATA_JSON, data, MODEL_CARD_SECTION, "application/json")
