"""When the app opens its model, how much it waits for the network: one function.

``local`` never waits (the installed model, or :class:`~.errors.NotInstalledError`);
``local_then_update`` opens the installed model and updates in a background thread
(its result goes to the updater's ``on_completed`` / ``on_failed``; the next
:func:`~.slots.open_slot` opens the new model, the one already open keeps serving);
``latest`` updates first and raises if that failed, so the model it opens is the
newest the server offers this device.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .slots import SlotDir, open_slot
from .updater import Updater

__all__ = ["POLICIES", "open_with_policy", "update_in_background"]

POLICIES = ("local", "local_then_update", "latest")


def open_with_policy(
    slot_dir: str | os.PathLike[str],
    policy: str,
    updater: Updater | None = None,
    **open_kwargs: Any,
):  # -> Model
    """Open the model of ``slot_dir`` under ``policy`` (one of :data:`POLICIES`).

    ``updater`` (for the same ``slot_dir``) is needed by the two policies that update;
    ``open_kwargs`` are as for :func:`edgepack.runtime_shim.open`.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown update policy {policy!r}: one of {', '.join(POLICIES)}")
    if policy != "local":
        if updater is None:
            raise ValueError(f"policy {policy!r} needs an updater")
        if updater.slots.root != SlotDir(slot_dir).root:
            raise ValueError(f"the updater keeps {updater.slots.root}, not {slot_dir}")
    if policy == "latest":
        result = updater.check_and_apply()
        if result.result == "failed":
            raise updater.last_error
        return open_slot(slot_dir, **open_kwargs)
    model = open_slot(slot_dir, **open_kwargs)
    if policy == "local_then_update":
        update_in_background(updater)
    return model


def update_in_background(updater: Updater) -> threading.Thread:
    """Run ``updater.check_and_apply()`` in a daemon thread (results via its callbacks).

    The update writes only the inactive slot, so models already open keep serving.
    An updater does one run at a time: do not start another before this one reports.
    """
    thread = threading.Thread(
        target=updater.check_and_apply, name="edgepack-update", daemon=True
    )
    thread.start()
    return thread
