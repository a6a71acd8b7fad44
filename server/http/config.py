"""Every knob and bound of ``edgepack serve`` in one frozen object.

The config travels to uvicorn's worker processes as JSON in an environment variable
(``EDGEPACK_SERVE_CONFIG``), so ``--workers N`` and N replicas on N machines all build
the same app from the same values.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CONFIG_ENV", "ServeConfig"]

CONFIG_ENV = "EDGEPACK_SERVE_CONFIG"


@dataclass(frozen=True)
class ServeConfig:
    """What one server process needs; nothing here is state (that is the store's)."""

    store_url: str
    endpoint_url: str | None = None
    # bounded staleness: timestamp.json is re-read at most this often, so a publish is
    # visible to every replica at most ``refresh_seconds`` (plus one metadata load) later
    refresh_seconds: float = 2.0
    # S3 only: answer payload requests with a presigned URL valid this long
    redirect: bool = False
    presign_seconds: int = 300
    # request bounds (larger bodies: 413; fields out of bounds: 422)
    max_body_bytes: int = 64 * 1024
    # payload streaming
    chunk_bytes: int = 1024 * 1024
    # on-demand deltas: how long a replica's lease on computing a pair lasts, and how
    # long an update check waits for a computation before answering `full`
    delta_lease_seconds: float = 600.0
    delta_wait_seconds: float = 5.0
    delta_waiters: int = 32
    on_demand_deltas: bool = True

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServeConfig:
        raw = (os.environ if environ is None else environ).get(CONFIG_ENV)
        if not raw:
            raise RuntimeError(f"{CONFIG_ENV} is not set (start the server with `edgepack serve`)")
        return cls(**json.loads(raw))
