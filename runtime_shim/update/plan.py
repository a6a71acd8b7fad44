"""The update-check answer, checked against the TUF-signed targets before any use.

The answer itself is not signed: every path, length and hash in it is either equal to
the signed target of that path (releases, precomputed deltas, adapter releases) or, for
an on-demand delta, only bounded (its output is what gets verified, against the signed
release). An ``adapter`` plan names exactly one signed ``adapter`` target: an
adapter-only package for the installed base, installed next to it (the base stays).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from edgepack.format.compat import semver_key
from edgepack.format.constants import TUF_CUSTOM_KEY

from .config import UpdateConfig
from .download import Chunks
from .errors import MetadataError, RollbackError, UnsafeTargetError

__all__ = ["CUSTOM_KEY", "PlannedTarget", "UpdateCheckResult", "safe_target_path", "verify_plan"]

CUSTOM_KEY = TUF_CUSTOM_KEY  # the custom field of a target's TUF info the publisher writes
_PLANS = ("none", "adapter", "delta", "full")
_KINDS = ("package", "delta", "adapter")


@dataclass(frozen=True)
class PlannedTarget:
    path: str
    kind: str
    length: int
    sha256: str
    signed: bool
    chunks: Chunks | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunks"] = None if self.chunks is None else {
            "size": self.chunks.size, "sha256": list(self.chunks.sha256)
        }
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PlannedTarget:
        c = d.get("chunks")
        chunks = None if c is None else Chunks(int(c["size"]), tuple(c["sha256"]))
        return cls(d["path"], d["kind"], int(d["length"]), d["sha256"], bool(d["signed"]), chunks)


@dataclass(frozen=True)
class UpdateCheckResult:
    """A verified plan: ``package`` is the signed release target the device ends with."""

    plan: str
    release: str | None
    reason: str
    targets: tuple[PlannedTarget, ...] = ()

    @property
    def package(self) -> PlannedTarget | None:
        return next((t for t in self.targets if t.kind == "package"), None)

    @property
    def delta(self) -> PlannedTarget | None:
        return next((t for t in self.targets if t.kind == "delta"), None)

    @property
    def adapter(self) -> PlannedTarget | None:
        return next((t for t in self.targets if t.kind == "adapter"), None)

    @property
    def installs(self) -> PlannedTarget | None:
        """What the device ends with: the release package, or (``adapter`` plan) the
        adapter package installed next to the kept base."""
        return self.adapter if self.plan == "adapter" else self.package

    @property
    def download_bytes(self) -> int:
        first = self.delta if self.plan == "delta" else self.installs
        return first.length if first is not None else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "release": self.release,
            "reason": self.reason,
            "targets": [t.to_json() for t in self.targets],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> UpdateCheckResult:
        targets = tuple(PlannedTarget.from_json(t) for t in d["targets"])
        return cls(d["plan"], d["release"], d["reason"], targets)


def safe_target_path(path: Any) -> str:
    """A relative ``a/b/c`` path: no ``..``, no absolute path, no backslash or NUL."""
    if not isinstance(path, str) or not path or len(path) > 1024:
        raise UnsafeTargetError("a target path is missing or too long")
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or any(
        c in path for c in "\\\0%"
    ):
        raise UnsafeTargetError(f"unsafe target path {path[:200]!r}")
    return path


def verify_plan(
    answer: Any,
    get_targetinfo,  # (path) -> tuf TargetFile | None
    config: UpdateConfig,
    installed_version: str | None,
    installed_sha256: str | None,
) -> UpdateCheckResult:
    if not isinstance(answer, dict) or answer.get("plan") not in _PLANS:
        raise MetadataError("the update-check answer has no valid plan")
    plan = answer["plan"]
    reason = str(answer.get("reason", ""))[:4096]
    if plan == "none":
        return UpdateCheckResult("none", answer.get("release"), reason)
    raw = answer.get("targets")
    if not isinstance(raw, list) or not 1 <= len(raw) <= 8:
        raise MetadataError("the update-check answer lists no targets")
    out = []
    for t in raw:
        if not isinstance(t, dict) or t.get("kind") not in _KINDS:
            raise MetadataError("a planned target is malformed")
        path = safe_target_path(t.get("path"))
        length, sha256 = t.get("length"), t.get("sha256")
        if not isinstance(length, int) or not 0 <= length <= config.max_target_bytes:
            raise MetadataError(f"target {path}: length out of bounds")
        if not isinstance(sha256, str) or len(sha256) != 64:
            raise MetadataError(f"target {path}: no SHA-256")
        signed = t.get("signed", True) is not False or t["kind"] in ("package", "adapter")
        chunks = None
        if signed:
            info = get_targetinfo(path)
            if info is None:
                raise UnsafeTargetError(f"target {path} is not in the signed targets metadata")
            if info.length != length or info.hashes.get("sha256") != sha256:
                raise UnsafeTargetError(f"target {path}: size or hash is not the signed one")
            custom = info.custom.get(CUSTOM_KEY) if isinstance(info.custom, dict) else None
            chunks = _chunks(custom, length)
            if t["kind"] == "package":
                _check_not_older(custom, path, installed_version, installed_sha256, sha256)
        out.append(PlannedTarget(path, t["kind"], length, sha256, signed, chunks))
    result = UpdateCheckResult(plan, answer.get("release"), reason, tuple(out))
    if plan == "adapter":
        if len(out) != 1 or result.adapter is None:
            raise MetadataError("an adapter plan names exactly one adapter target")
    elif result.package is None or (plan == "delta" and result.delta is None):
        raise MetadataError(f"a {plan} plan without its package (and delta) target")
    return result


def _chunks(custom: Any, length: int) -> Chunks | None:
    c = custom.get("chunks") if isinstance(custom, dict) else None
    if not isinstance(c, dict):
        return None
    size, hashes = c.get("size"), c.get("sha256")
    if not isinstance(size, int) or size < 1 or not isinstance(hashes, list):
        raise MetadataError("signed chunk hashes are malformed")
    if len(hashes) != -(-length // size) or not all(isinstance(h, str) for h in hashes):
        raise MetadataError("signed chunk hashes do not cover the target")
    return Chunks(size, tuple(hashes))


def _check_not_older(
    custom: Any, path: str, installed: str | None, installed_sha: str | None, sha256: str
) -> None:
    version = custom.get("version") if isinstance(custom, dict) else None
    if installed is None or not isinstance(version, str) or sha256 == installed_sha:
        return
    try:
        older = semver_key(version) <= semver_key(installed)
    except ValueError:
        raise MetadataError(f"target {path}: version {version[:64]!r} is not semver") from None
    if older:
        raise RollbackError(
            f"{path} is version {version}, not newer than the installed {installed}"
        )
