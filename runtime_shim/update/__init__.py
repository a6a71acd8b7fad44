"""edgepack.runtime_shim.update: keep an on-device model current, safely.

Shaped like python-tuf's ngclient: :class:`Updater` (policy and I/O), python-tuf's
trusted metadata state (in :mod:`.trust`), our fetcher with Range resume, a bandwidth
cap and progress (:mod:`.fetcher`), and one :class:`UpdateConfig` bounding every size,
count and time. Needs the ``edgepack[update]`` extra (python-tuf), imported only when
an update runs; the server is never imported.

    updater = Updater("https://updates.example", "/data/model", "root.json",
                      device_id="device-42", channel="stable", model="chat")
    result = updater.check_and_apply()       # result.result: updated, up_to_date, ...
    model = edgepack.runtime_shim.open_slot("/data/model")
    handles = [model.load_adapter(p) for p in slot_adapters("/data/model")]  # adapter plans
    model = open_with_policy("/data/model", "local_then_update", updater)  # see .policy
"""

from . import errors
from .config import UpdateConfig
from .errors import *  # noqa: F403 (the error classes are part of this API)
from .plan import UpdateCheckResult
from .policy import POLICIES, open_with_policy, update_in_background
from .slots import SlotDir, open_slot, slot_adapters
from .updater import Updater, UpdateResult

__all__ = [
    "POLICIES",
    "SlotDir",
    "UpdateCheckResult",
    "UpdateConfig",
    "UpdateResult",
    "Updater",
    "open_slot",
    "open_with_policy",
    "slot_adapters",
    "update_in_background",
]
__all__ += errors.__all__  # the error classes, listed once in errors.py
