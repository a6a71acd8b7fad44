"""edgepack.server.releases: signed release metadata (The Update Framework) on a store.

Layers, each usable on its own:

* :mod:`.model` - what a release is (custom target fields, channels, semver order,
  staged rollout by hashed device id, compatibility from the recorded requirements):
  pure values, no I/O;
* :mod:`.metadata` - build, sign and verify TUF metadata with ``tuf.api.metadata``:
  no I/O;
* :mod:`.keys` - the keys directory (signers, retirement, per-store pinned state);
* :mod:`.repository` - :class:`ReleaseRepository`: init, publish, promote,
  rotate-key, refresh and verify over a store, with the atomic commit protocol;
* :mod:`.fetcher` - :class:`StoreFetcher` for ``tuf.ngclient`` and the mapping of
  python-tuf errors into edgepack's error tree;
* :mod:`.deltas` - the adapter to the delta codec (skips when it is unavailable).
"""

from __future__ import annotations

from .fetcher import METADATA_URL, TARGETS_URL, StoreFetcher, map_tuf_error, target_object_key
from .keys import DEFAULT_KEYS_DIR, KeyRing
from .metadata import RepoPolicy, VerifiedRepository
from .model import (
    DeltaInfo,
    ReleaseIndex,
    ReleaseInfo,
    Requirements,
    in_rollout,
    semver_precedence,
)
from .repository import PackageFacts, PublishResult, ReleaseRepository, inspect_package

__all__ = [
    "DEFAULT_KEYS_DIR",
    "METADATA_URL",
    "TARGETS_URL",
    "DeltaInfo",
    "KeyRing",
    "PackageFacts",
    "PublishResult",
    "ReleaseIndex",
    "ReleaseInfo",
    "ReleaseRepository",
    "RepoPolicy",
    "Requirements",
    "StoreFetcher",
    "VerifiedRepository",
    "in_rollout",
    "inspect_package",
    "map_tuf_error",
    "semver_precedence",
    "target_object_key",
]
