"""Every size, count and time bound of the update client, in one place.

Like python-tuf's ``UpdaterConfig`` (whose metadata limits are taken from here), so a
reviewer can read what a hostile or broken server can cost a device: how many bytes,
how long, how many retries.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UpdateConfig"]


@dataclass(frozen=True)
class UpdateConfig:
    """Bounds of one update run. Times are seconds, sizes bytes."""

    # HTTP: a connection must open within connect_timeout, every read return within
    # read_timeout, and after slow_grace a download must average min_bytes_per_second
    # (a server dripping one byte a second is cut off, not waited for).
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    slow_grace: float = 10.0
    min_bytes_per_second: int = 4096
    # bandwidth cap of payload downloads (None: as fast as the network goes)
    max_bytes_per_second: int | None = None
    # read size of payload downloads, and the unit of resume when no chunk hashes are signed
    read_bytes: int = 256 * 1024
    # retriable failures (connection reset, 5xx, a bad chunk) per target before giving up
    max_attempts: int = 4
    retry_backoff: float = 0.5
    # the update-check answer and the TUF metadata files
    max_check_bytes: int = 64 * 1024
    max_root_rotations: int = 32
    root_max_length: int = 512 * 1024
    timestamp_max_length: int = 16 * 1024
    snapshot_max_length: int = 2 * 1024 * 1024
    targets_max_length: int = 8 * 1024 * 1024
    # largest package or delta accepted at all, whatever the signed metadata says
    max_target_bytes: int = 64 * 1024**3
    # free space kept on the slot directory's filesystem after a download and staging
    free_space_margin: int = 16 * 1024 * 1024
    # health check: a forward pass on these token ids must give finite logits
    health_prompt_ids: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    # packages are opened with these many kernel threads during the health check
    health_threads: int | None = 1

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout", "slow_grace", "retry_backoff"):
            if getattr(self, name) < 0:
                raise ValueError(f"UpdateConfig.{name} must be >= 0")
        for name in ("read_bytes", "max_attempts", "max_check_bytes", "max_target_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"UpdateConfig.{name} must be >= 1")
        if self.max_bytes_per_second is not None and self.max_bytes_per_second < 1:
            raise ValueError("UpdateConfig.max_bytes_per_second must be >= 1 or None")
        if not self.health_prompt_ids:
            raise ValueError("UpdateConfig.health_prompt_ids must not be empty")

    def tuf_config(self):  # -> tuf.ngclient.UpdaterConfig (imported lazily)
        """python-tuf's config with our metadata bounds."""
        from tuf.ngclient import UpdaterConfig

        return UpdaterConfig(
            max_root_rotations=self.max_root_rotations,
            root_max_length=self.root_max_length,
            timestamp_max_length=self.timestamp_max_length,
            snapshot_max_length=self.snapshot_max_length,
            targets_max_length=self.targets_max_length,
        )
