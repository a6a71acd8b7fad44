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


class _AnswerOnly:
    """A fetcher whose update-check answer is given (no network)."""

    def __init__(self, status: int, answer: object) -> None:
        self.status, self.answer = status, answer

    def post_json(self, url: str, body: dict, max_bytes: int) -> tuple[int, object]:
        return self.status, self.answer

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "answer",
    [
        {"reason": "full", "needed_bytes": "lots", "free_bytes": None},
        {"needed_bytes": -5, "free_bytes": True},
        {"needed_bytes": 1.5e300},
    ],
)
def test_a_hostile_storage_refusal_is_typed(tmp_path, answer):
    from edgepack.runtime_shim.update import InsufficientStorageError, Updater
    from edgepack.runtime_shim.update.slots import Journal

    updater = Updater("http://127.0.0.1:9", tmp_path, b"{}", device_id="d", channel="c", model="m")
    updater._fetcher = _AnswerOnly(409, answer)
    with pytest.raises(InsufficientStorageError) as caught:
        updater._ask("m", Journal())
    assert caught.value.needed_bytes == 0 and caught.value.free_bytes == 0
