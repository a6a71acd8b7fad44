"""The keys directory: TUF signing keys, kept on the operator's side, never in the store.

Layout (default ``./edgepack-keys/``)::

    <role>-<keyid[:16]>.key   Ed25519 private key, PKCS#8 PEM, mode 0600
    <role>-<keyid[:16]>.pub   its public key (SubjectPublicKeyInfo PEM)
    retired/                  keys rotated out (kept, never used to sign again)
    state/repo-<id>.json      per repository (its id: the SHA-256 of its first root, so
                              no path or URL spelling changes it): the pinned root
                              (version, sha256) and the highest metadata versions
                              seen, to detect rollbacks

The file name is for people; which role a key signs for is decided by the store's
root metadata (matched by key id), so one directory can serve several repositories
and a key file can be moved between machines (e.g. root keys offline, the online
targets/snapshot/timestamp keys in CI).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from securesystemslib.signer import CryptoSigner, SSlibKey

from ..errors import MissingKeyError

__all__ = ["DEFAULT_KEYS_DIR", "KeyRing"]

DEFAULT_KEYS_DIR = "edgepack-keys"
log = logging.getLogger("edgepack.server.releases")


class KeyRing:
    """Signers loaded from a keys directory, matched to roles by a root's key ids."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._signers: dict[str, CryptoSigner] | None = None

    # -- keys -------------------------------------------------------------------
    def generate(self, role: str) -> SSlibKey:
        """Create a new Ed25519 key for ``role`` and return its public key."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        private = Ed25519PrivateKey.generate()
        public = SSlibKey.from_crypto(private.public_key())
        stem = self.directory / f"{role}-{public.keyid[:16]}"
        pem = private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(stem.with_suffix(".key"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        stem.with_suffix(".pub").write_bytes(
            private.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        self._signers = None
        return public

    def signers(self) -> dict[str, CryptoSigner]:
        """Every usable key in the directory, by TUF key id."""
        if self._signers is None:
            found: dict[str, CryptoSigner] = {}
            for path in sorted(self.directory.glob("*.key")) if self.directory.is_dir() else []:
                try:
                    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
                except (ValueError, TypeError, OSError) as exc:
                    log.warning("ignoring unreadable key %s: %s", path, exc)
                    continue
                if not isinstance(key, Ed25519PrivateKey):
                    log.warning("ignoring %s: not an Ed25519 key", path)
                    continue
                public = SSlibKey.from_crypto(key.public_key())
                found[public.keyid] = CryptoSigner(key, public)
            self._signers = found
        return self._signers

    def signers_for(self, root: Any, role: str) -> list[CryptoSigner]:
        """The keys of this directory that ``root`` authorizes for ``role``."""
        have = self.signers()
        return [have[k] for k in root.roles[role].keyids if k in have]

    def require(self, root: Any, role: str) -> list[CryptoSigner]:
        """Like :meth:`signers_for`, but at least the role's threshold of them."""
        signers = self.signers_for(root, role)
        threshold = root.roles[role].threshold
        if len(signers) < threshold:
            raise MissingKeyError(
                f"the keys directory {self.directory} holds {len(signers)} of the "
                f"{threshold} {role} key(s) the repository requires"
            )
        return signers

    def retire(self, keyids: list[str]) -> None:
        """Move the files of these keys to ``retired/``."""
        retired = self.directory / "retired"
        for path in list(self.directory.glob("*.key")):
            signer = self._signer_for_file(path)
            if signer is not None and signer.public_key.keyid in keyids:
                retired.mkdir(mode=0o700, exist_ok=True)
                for p in (path, path.with_suffix(".pub")):
                    if p.exists():
                        os.replace(p, retired / p.name)
        self._signers = None

    def _signer_for_file(self, path: Path) -> CryptoSigner | None:
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError, OSError):
            return None
        if not isinstance(key, Ed25519PrivateKey):
            return None
        return CryptoSigner(key, SSlibKey.from_crypto(key.public_key()))

    # -- per-repository state ------------------------------------------------------------
    def _state_path(self, repository_id: str) -> Path:
        return self.directory / "state" / f"repo-{repository_id[:32]}.json"

    def _legacy_state_path(self, store_url: str) -> Path:
        """Where edgepack before repository ids kept the state: by the literal URL."""
        sid = hashlib.sha256(store_url.encode()).hexdigest()[:16]
        return self.directory / "state" / f"{sid}.json"

    def load_state(self, repository_id: str, *, legacy_url: str | None = None) -> dict[str, Any]:
        """The trusted state of the repository ``repository_id`` (see
        :func:`~.metadata.repository_id`), whatever URL or path spelling reached it.

        Migration: with no state under the id yet, the state an older edgepack recorded
        under ``legacy_url`` (the literal store URL) is adopted, and saved under the id on
        the next commit."""
        data = self._read_state(self._state_path(repository_id))
        if data is not None:
            return data if data.get("repository_id") == repository_id else {}
        if legacy_url is not None:
            old = self._read_state(self._legacy_state_path(legacy_url))
            if old is not None and old.get("url") == legacy_url:
                log.info("adopting the state recorded for %s", legacy_url)
                return {k: v for k, v in old.items() if k != "url"}
        return {}

    def states(self) -> dict[str, dict[str, Any]]:
        """Every repository state this directory holds, by repository id."""
        out = {}
        for path in sorted((self.directory / "state").glob("repo-*.json")):
            data = self._read_state(path)
            if data is not None and isinstance(data.get("repository_id"), str):
                out[data["repository_id"]] = data
        return out

    def _read_state(self, path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable state file: %s", exc)
            return None
        return data if isinstance(data, dict) else None

    def save_state(self, repository_id: str, state: dict[str, Any]) -> None:
        """Best effort: a read-only keys directory only loses rollback detection."""
        path = self._state_path(repository_id)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
            tmp.write_text(
                json.dumps({**state, "repository_id": repository_id}, indent=2, sort_keys=True)
            )
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not record repository state in %s: %s", path.parent, exc)
