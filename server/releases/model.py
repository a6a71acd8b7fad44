"""What a release is, as plain values: no I/O, no signing.

A *release* is one package on one channel. It is a TUF target whose path is
``<model>/<channel>/<model>-<version>.epk`` and whose ``custom["edgepack"]`` holds the
fields below; promoting a version to another channel adds a second target for the same
bytes. A *delta* (precomputed by publish) is a target too, at
``<model>/deltas/<from-sha256>-<to-sha256>.epkd``, listed by the releases it leads to.

The bytes of every target live once, content addressed, at ``objects/sha256/<hex>``.

Custom fields (schema 1)::

    {"edgepack": {"schema": 1, "kind": "release", "model": "chat", "version": "1.4.0",
                  "channel": "beta", "rollout_bp": 1000, "published": "2025-...Z",
                  "signers": ["<key id hex>"],
                  "requirements": {"format_version": 1, "min_runtime_version": "0.1.0",
                                   "quantization_schema_version": 1,
                                   "operator_set_version": 1,
                                   "required_operators": [["llama.decoder", 1]],
                                   "required_features": [], "encodings": [0, 20]},
                  "deltas": [{"from_version": "1.3.0", "from_sha256": "...",
                              "path": "chat/deltas/<a>-<b>.epkd", "sha256": "...",
                              "length": 1234}],
                  "model_card": {"license": "apache-2.0", "description": "...",
                                 "origin": {"license": "gguf general.license", ...}}}}

``model_card`` is the package's card (spec/FORMAT.md 5b) when it has one, so a listing
of releases shows the license and intended use without fetching the package.

``rollout_bp`` is the rollout in basis points (1/100 of a percent: canonical JSON, which
TUF signs, has no floats). Staged rollout is by hashed device id: a device is in when
``sha256("<model>/<channel>/<version>/<device id>")`` read as a big-endian integer of its
first 8 bytes, modulo 10000, is below ``rollout_bp`` - stable per release, so raising the
percentage only adds devices.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edgepack.format import CompatibilityVerdict, Header, ModelIdentity, RuntimeCapabilities
from edgepack.format.compat import check_compatibility, parse_semver
from edgepack.format.constants import TUF_CUSTOM_KEY
from edgepack.format.names import check_name  # one rule for every layer

from ..store.base import object_key

__all__ = [
    "CUSTOM_KEY",
    "DeltaInfo",
    "ReleaseIndex",
    "ReleaseInfo",
    "Requirements",
    "check_name",
    "chunk_hashes",
    "delta_target_path",
    "in_rollout",
    "percent_to_bp",
    "release_target_path",
    "semver_precedence",
]

CUSTOM_KEY = TUF_CUSTOM_KEY
SCHEMA = 1
# a release's bytes are also hashed in chunks of this size, signed with its target, so
# a device verifies a download as it arrives (and refetches one bad chunk, not the file)
CHUNK_BYTES = 256 * 1024


def chunk_hashes(path: Any, size: int = CHUNK_BYTES) -> tuple[str, ...]:
    """SHA-256 of each ``size``-byte chunk of the file at ``path`` (the last one shorter)."""
    out = []
    with open(path, "rb") as f:
        while chunk := f.read(size):
            out.append(hashlib.sha256(chunk).hexdigest())
    return tuple(out)



def semver_precedence(version: str) -> tuple:
    """Sort key implementing semantic-version precedence (build metadata ignored;
    a pre-release sorts before its release; numeric identifiers below alphanumeric)."""
    major, minor, patch, pre = parse_semver(version)
    if not pre:
        return (major, minor, patch, 1, ())
    idents = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split(".") if p != "")
    return (major, minor, patch, 0, idents)


def percent_to_bp(percent: float) -> int:
    if not 0 <= percent <= 100:
        raise ValueError(f"rollout must be between 0 and 100 percent, not {percent}")
    bp = round(percent * 100)
    if abs(bp - percent * 100) > 1e-6:
        raise ValueError(f"rollout {percent} has more than two decimals")
    return bp


def release_target_path(model: str, channel: str, version: str) -> str:
    check_name("model", model)
    check_name("channel", channel)
    parse_semver(version)
    return f"{model}/{channel}/{model}-{version}.epk"


def delta_target_path(model: str, from_sha256: str, to_sha256: str) -> str:
    check_name("model", model)
    return f"{model}/deltas/{from_sha256}-{to_sha256}.epkd"


def in_rollout(device_id: str, model: str, channel: str, version: str, rollout_bp: int) -> bool:
    if rollout_bp >= 10_000:
        return True
    if rollout_bp <= 0:
        return False
    digest = hashlib.sha256(f"{model}/{channel}/{version}/{device_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 < rollout_bp


@dataclass(frozen=True)
class Requirements:
    """What a runtime must support to run the package (from its header)."""

    format_version: int
    min_runtime_version: str
    quantization_schema_version: int
    operator_set_version: int
    required_operators: tuple[tuple[str, int], ...] = ()
    required_features: tuple[str, ...] = ()
    encodings: tuple[int, ...] = ()

    @classmethod
    def from_header(cls, header: Header) -> Requirements:
        return cls(
            format_version=header.format_version,
            min_runtime_version=header.min_runtime_version,
            quantization_schema_version=header.quantization_schema_version,
            operator_set_version=header.operator_set_version,
            required_operators=tuple((n, int(v)) for n, v in header.required_operators),
            required_features=tuple(header.required_features),
            encodings=tuple(sorted({int(t.encoding) for t in header.tensors})),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "min_runtime_version": self.min_runtime_version,
            "quantization_schema_version": self.quantization_schema_version,
            "operator_set_version": self.operator_set_version,
            "required_operators": [[n, v] for n, v in self.required_operators],
            "required_features": list(self.required_features),
            "encodings": list(self.encodings),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Requirements:
        return cls(
            format_version=int(d["format_version"]),
            min_runtime_version=str(d["min_runtime_version"]),
            quantization_schema_version=int(d["quantization_schema_version"]),
            operator_set_version=int(d["operator_set_version"]),
            required_operators=tuple((str(n), int(v)) for n, v in d["required_operators"]),
            required_features=tuple(str(f) for f in d.get("required_features", ())),
            encodings=tuple(int(e) for e in d.get("encodings", ())),
        )

    def check(self, caps: RuntimeCapabilities) -> CompatibilityVerdict:
        """The same verdict the device computes from the package header."""
        from edgepack.format import Encoding, TensorEntry

        tensors = []
        for i, enc in enumerate(self.encodings):
            try:
                encoding = Encoding(enc)
            except ValueError:
                continue  # unknown to this edgepack: caps cannot list it either
            tensors.append(TensorEntry(f"t{i}", (1,), encoding))
        missing = sorted(set(self.encodings) - {int(t.encoding) for t in tensors})
        header = Header(
            identity=ModelIdentity("", "0.0.0", ""),
            min_runtime_version=self.min_runtime_version,
            tensors=tuple(tensors),
            required_operators=self.required_operators,
            required_features=self.required_features,
            format_version=self.format_version,
            quantization_schema_version=self.quantization_schema_version,
            operator_set_version=self.operator_set_version,
        )
        verdict = check_compatibility(header, caps)
        if missing:
            from edgepack.format import CompatibilityProblem

            problem = CompatibilityProblem(
                "encoding",
                f"tensor encodings {missing} are not supported",
                "update the app to a newer edgepack runtime, or fetch a package built for this one",
            )
            verdict = CompatibilityVerdict((*verdict.problems, problem))
        return verdict


@dataclass(frozen=True)
class DeltaInfo:
    from_version: str
    from_sha256: str
    path: str
    sha256: str
    length: int

    @property
    def object_key(self) -> str:
        return object_key(self.sha256)

    def to_dict(self) -> dict[str, Any]:
        return {
            "from_version": self.from_version,
            "from_sha256": self.from_sha256,
            "path": self.path,
            "sha256": self.sha256,
            "length": self.length,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeltaInfo:
        return cls(
            str(d["from_version"]),
            str(d["from_sha256"]),
            str(d["path"]),
            str(d["sha256"]),
            int(d["length"]),
        )


@dataclass(frozen=True)
class ReleaseInfo:
    """One release target, read from (or written to) signed targets metadata."""

    path: str
    model: str
    version: str
    channel: str
    rollout_bp: int
    sha256: str
    length: int
    requirements: Requirements
    published: str = ""
    signers: tuple[str, ...] = ()
    deltas: tuple[DeltaInfo, ...] = field(default=())
    chunks: tuple[str, ...] = ()  # chunk_hashes() of the package, chunk_bytes each
    chunk_bytes: int = CHUNK_BYTES
    model_card: Mapping[str, Any] | None = None  # the package's, read at publish
    weights_digest: str = ""  # hex weights digest of the package ("": not recorded)
    # an adapter-only release: the weights digests its adapters are bound to
    adapter_for: tuple[str, ...] = ()

    @property
    def is_adapter(self) -> bool:
        return bool(self.adapter_for)

    @property
    def rollout_percent(self) -> float:
        return self.rollout_bp / 100

    @property
    def object_key(self) -> str:
        return object_key(self.sha256)

    def in_rollout(self, device_id: str) -> bool:
        return in_rollout(device_id, self.model, self.channel, self.version, self.rollout_bp)

    def delta_from(self, sha256: str) -> DeltaInfo | None:
        return next((d for d in self.deltas if d.from_sha256 == sha256), None)

    def custom(self) -> dict[str, Any]:
        return {
            CUSTOM_KEY: {
                "schema": SCHEMA,
                "kind": "release",
                "model": self.model,
                "version": self.version,
                "channel": self.channel,
                "rollout_bp": self.rollout_bp,
                "published": self.published,
                "signers": list(self.signers),
                "requirements": self.requirements.to_dict(),
                "deltas": [d.to_dict() for d in self.deltas],
                **({"chunks": {"size": self.chunk_bytes, "sha256": list(self.chunks)}}
                   if self.chunks else {}),
                **({"model_card": dict(self.model_card)} if self.model_card else {}),
                **({"weights_digest": self.weights_digest} if self.weights_digest else {}),
                **({"adapter_for": list(self.adapter_for)} if self.adapter_for else {}),
            }
        }

    @classmethod
    def from_target(cls, path: str, length: int, hashes: Mapping[str, str], custom: Any):
        """Parse a target's fields; None for targets that are not releases."""
        info = custom.get(CUSTOM_KEY) if isinstance(custom, Mapping) else None
        if not isinstance(info, Mapping) or info.get("kind") != "release":
            return None
        return cls(
            path=path,
            model=str(info["model"]),
            version=str(info["version"]),
            channel=str(info["channel"]),
            rollout_bp=int(info["rollout_bp"]),
            sha256=str(hashes["sha256"]),
            length=int(length),
            requirements=Requirements.from_dict(info["requirements"]),
            published=str(info.get("published", "")),
            signers=tuple(str(s) for s in info.get("signers", ())),
            deltas=tuple(DeltaInfo.from_dict(d) for d in info.get("deltas", ())),
            chunks=tuple(str(h) for h in (info.get("chunks") or {}).get("sha256", ())),
            chunk_bytes=int((info.get("chunks") or {}).get("size", CHUNK_BYTES)),
            model_card=_card(info.get("model_card")),
            weights_digest=str(info.get("weights_digest", "")),
            adapter_for=tuple(str(d) for d in info.get("adapter_for", ())),
        )

    def to_json(self) -> dict[str, Any]:
        """A flat view for ``edgepack releases --json``."""
        return {
            "path": self.path,
            "model": self.model,
            "version": self.version,
            "channel": self.channel,
            "rollout_percent": self.rollout_percent,
            "sha256": self.sha256,
            "length": self.length,
            "published": self.published,
            "signers": list(self.signers),
            "requirements": self.requirements.to_dict(),
            "deltas": [d.to_dict() for d in self.deltas],
            "model_card": dict(self.model_card) if self.model_card else None,
            "weights_digest": self.weights_digest,
            "adapter_for": list(self.adapter_for),
        }


def _card(value: Any) -> Mapping[str, Any] | None:
    """A target's card as stored; anything but an object reads as none."""
    return dict(value) if isinstance(value, Mapping) and value else None


class ReleaseIndex:
    """Query releases: by model and channel, newest first, rollout and compatibility."""

    def __init__(self, releases: Iterable[ReleaseInfo]) -> None:
        self._all = sorted(
            releases, key=lambda r: (r.model, r.channel, semver_precedence(r.version))
        )

    @classmethod
    def from_targets(cls, targets: Any) -> ReleaseIndex:
        """From a ``tuf.api.metadata.Targets``."""
        out = []
        for path, tf in targets.targets.items():
            info = ReleaseInfo.from_target(path, tf.length, tf.hashes, tf.custom)
            if info is not None:
                out.append(info)
        return cls(out)

    def __iter__(self):
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def models(self) -> list[str]:
        return sorted({r.model for r in self._all})

    def channels(self, model: str | None = None) -> list[str]:
        return sorted({r.channel for r in self._all if model is None or r.model == model})

    def releases(self, model: str | None = None, channel: str | None = None) -> list[ReleaseInfo]:
        """Oldest first."""
        return [
            r
            for r in self._all
            if (model is None or r.model == model) and (channel is None or r.channel == channel)
        ]

    def latest(self, model: str, channel: str) -> ReleaseInfo | None:
        found = self.releases(model, channel)
        return found[-1] if found else None

    def find(self, model: str, version: str, channel: str | None = None) -> list[ReleaseInfo]:
        key = semver_precedence(version)
        return [
            r
            for r in self.releases(model, channel)
            if semver_precedence(r.version) == key and r.version == version
        ]

    def by_sha256(self, sha256: str) -> list[ReleaseInfo]:
        return [r for r in self._all if r.sha256 == sha256]

    def select(
        self,
        model: str,
        channel: str,
        device_id: str,
        capabilities: RuntimeCapabilities | None = None,
    ) -> ReleaseInfo | None:
        """The newest release on the channel this device is in the rollout of and (with
        ``capabilities``) can run; older ones are the fallback."""
        for release in reversed(self.releases(model, channel)):
            if not release.in_rollout(device_id):
                continue
            if capabilities is not None and not release.requirements.check(capabilities):
                continue
            return release
        return None
