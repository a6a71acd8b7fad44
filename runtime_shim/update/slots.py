"""The slot directory: two model slots, a journal, the TUF metadata and downloads.

    <slot_dir>/journal.json      which slot is active, and where an update stands
    <slot_dir>/a/model.epk       slot a
    <slot_dir>/b/model.epk       slot b
    <slot_dir>/a/adapters/       adapter-only packages installed for slot a's model,
                                 each named ``<sha256>.epk`` (:func:`slot_adapters`)
    <slot_dir>/tuf/              trusted TUF metadata (root.json, timestamp.json, ...)
    <slot_dir>/downloads/        verified downloads and resumable ``.part`` files

The journal is the only switch: it is replaced atomically and durably (after the files
it names are durable), so after a power cut at any instant it names a slot whose model
opens and verifies. States of an update: ``checked`` -> ``downloading`` ->
``downloaded`` -> ``staging`` -> ``staged`` -> ``switched`` -> ``healthy`` (committed)
or ``rolled_back``. Only ``switched`` names an active slot not yet proven healthy; the
next run finishes its health check (and switches back on failure). An ``adapter`` plan
keeps the active slot: the adapter is verified, bound to the slot's model and health
checked under a temporary name, then renamed into the slot's ``adapters/`` (durably); a
slot's adapters are removed before another model is staged into it, and copied over
from the active slot when the staged model has the same weights digest.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .durable import write_json_durably
from .errors import NotInstalledError, SlotError

__all__ = ["SLOTS", "STATES", "Journal", "SlotDir", "open_slot", "slot_adapters"]

SLOTS = ("a", "b")
MODEL_FILE = "model.epk"
JOURNAL_FILE = "journal.json"
JOURNAL_SCHEMA = 1
ADAPTER_DIR = "adapters"
_ADAPTER_NAME = re.compile(r"[0-9a-f]{64}\.epk")
STATES = (
    "idle",
    "checked",
    "downloading",
    "downloaded",
    "staging",
    "staged",
    "switched",
    "healthy",
    "rolled_back",
)


@dataclass(frozen=True)
class Journal:
    """What the slot directory holds; ``pending`` is the update in flight (or last done)."""

    state: str = "idle"
    active: str | None = None
    active_sha256: str | None = None
    active_version: str | None = None
    previous: str | None = None
    previous_sha256: str | None = None
    previous_version: str | None = None
    model: str | None = None
    pending: dict[str, Any] | None = None
    bad_sha256: tuple[str, ...] = ()
    reason: str = ""
    schema: int = JOURNAL_SCHEMA
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["bad_sha256"] = list(self.bad_sha256)
        return d

    @classmethod
    def from_json(cls, d: Any) -> Journal:
        if not isinstance(d, dict) or d.get("schema") != JOURNAL_SCHEMA:
            raise SlotError("the slot journal is not a schema-1 journal")
        try:
            j = cls(**{**d, "bad_sha256": tuple(d.get("bad_sha256", ()))})
        except TypeError as e:
            raise SlotError(f"the slot journal has unknown fields: {e}") from None
        if j.state not in STATES or j.active not in (None, *SLOTS):
            raise SlotError(f"the slot journal names state {j.state!r}, slot {j.active!r}")
        return j

    def evolve(self, **changes: Any) -> Journal:
        return replace(self, **changes)


class SlotDir:
    """Paths and the journal of one slot directory (created on first use)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.metadata_dir = self.root / "tuf"
        self.download_dir = self.root / "downloads"
        self.journal_path = self.root / JOURNAL_FILE

    def create(self) -> None:
        for d in (self.root, self.metadata_dir, self.download_dir, *map(self.slot_dir, SLOTS)):
            d.mkdir(parents=True, exist_ok=True)

    def slot_dir(self, slot: str) -> Path:
        return self.root / slot

    def model_path(self, slot: str) -> Path:
        return self.slot_dir(slot) / MODEL_FILE

    def adapter_dir(self, slot: str) -> Path:
        return self.slot_dir(slot) / ADAPTER_DIR

    def adapter_path(self, slot: str, sha256: str) -> Path:
        return self.adapter_dir(slot) / f"{sha256}.epk"

    def adapters(self, slot: str | None) -> list[Path]:
        """The adapter packages installed for ``slot``'s model (none for no slot)."""
        if slot is None or not self.adapter_dir(slot).is_dir():
            return []
        found = self.adapter_dir(slot).iterdir()
        return sorted(p for p in found if _ADAPTER_NAME.fullmatch(p.name))

    def adapter_sha256s(self, slot: str | None) -> list[str]:
        """The SHA-256 each of ``slot``'s adapters is named by (:meth:`adapter_path`)."""
        return [p.name.removesuffix(".epk") for p in self.adapters(slot)]

    def load(self) -> Journal:
        try:
            raw = self.journal_path.read_bytes()
        except FileNotFoundError:
            return Journal()
        try:
            return Journal.from_json(json.loads(raw.decode("utf-8")))
        except ValueError:  # UnicodeDecodeError is one too
            raise SlotError(f"{self.journal_path} is not JSON") from None

    def save(self, journal: Journal) -> Journal:
        write_json_durably(self.journal_path, journal.to_json())
        return journal

    @staticmethod
    def other(slot: str | None) -> str:
        return "b" if slot == "a" else "a"

    def active_model(self) -> Path:
        journal = self.load()
        if journal.active is None:
            raise NotInstalledError(
                f"{self.root}: no model installed yet; update first (policy 'latest' or "
                "`edgepack update`)"
            )
        return self.model_path(journal.active)


def open_slot(slot_dir: str | os.PathLike[str], **open_kwargs: Any):  # -> Model
    """Open the model active in ``slot_dir`` (``open_kwargs`` as for
    :func:`edgepack.runtime_shim.open`)."""
    from ..model import open as open_model

    return open_model(SlotDir(slot_dir).active_model(), **open_kwargs)


def slot_adapters(slot_dir: str | os.PathLike[str]) -> list[Path]:
    """The adapter packages installed for the model active in ``slot_dir``, for
    ``model.load_adapter`` (each verified and bound to that model when installed)."""
    slots = SlotDir(slot_dir)
    return slots.adapters(slots.load().active)
