"""Does a native call release the GIL? Answered by thread order, not by a stopwatch.

With the switch interval raised far beyond any call, Python threads never preempt each
other: the only way the main thread can run while a worker is inside ``call`` is that
``call`` released the GIL. So a call that holds it can never pass, however slow or loaded
the machine; a call that releases it passes unless the scheduler lets every one of the
``tries`` calls finish before the main thread wakes (then each try is inconclusive).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

NO_PREEMPTION_S = 1000.0  # longer than any call: the interpreter never forces a switch


def runs_python_during(call: Callable[[], object], tries: int = 20) -> bool:
    """True once the main thread ran Python code while ``call`` had not yet returned."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(NO_PREEMPTION_S)
    try:
        for _ in range(tries):
            if _one_try(call):
                return True
        return False
    finally:
        sys.setswitchinterval(previous)


def _one_try(call: Callable[[], object]) -> bool:
    returned = threading.Event()

    def worker() -> None:
        call()
        returned.set()

    thread = threading.Thread(target=worker)
    thread.start()  # waits for the worker to start: from here on the worker holds the GIL
    # the worker gives the GIL back only inside `call` (if it releases it) or when it ends
    overlapped = not returned.is_set()
    thread.join()
    return overlapped
