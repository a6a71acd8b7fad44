"""A damaged slot journal is a typed SlotError, whatever the bytes."""

from __future__ import annotations

import pytest

from edgepack.runtime_shim.update import SlotDir, SlotError


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff\xfe not utf-8",
        b"[1, 2]",
        b'{"schema": 2}',
        b'{"schema": 1, "state": "flying"}',
        b'{"schema": 1, "active": "c"}',
        b'{"schema": 1, "surprise": true}',
        b'{"schema": 1, "bad_sha256": 7}',
    ],
)
def test_damaged_journal_is_a_slot_error(tmp_path, raw):
    slots = SlotDir(tmp_path)
    slots.create()
    slots.journal_path.write_bytes(raw)
    with pytest.raises(SlotError):
        slots.load()


def test_missing_journal_is_a_fresh_directory(tmp_path):
    assert SlotDir(tmp_path).load().active is None
