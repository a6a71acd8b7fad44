"""Can this runtime run that package?  One verdict, used by the device and the server.

A runtime declares what it supports as :class:`RuntimeCapabilities`;
:func:`check_compatibility` compares a header with it and returns every problem
found, each with what the user should do about it, instead of stopping at the first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .constants import FORMAT_MAJOR, Encoding
from .header import Header

__all__ = [
    "CompatibilityProblem",
    "CompatibilityVerdict",
    "RuntimeCapabilities",
    "check_compatibility",
    "parse_semver",
]

_SEMVER = re.compile(
    r"^(0|[1-9]\d{0,8})\.(0|[1-9]\d{0,8})\.(0|[1-9]\d{0,8})"
    r"(?:-([0-9A-Za-z.-]{1,64}))?(?:\+[0-9A-Za-z.-]{1,64})?$"
)


def parse_semver(text: str) -> tuple[int, int, int, str]:
    """Parse ``MAJOR.MINOR.PATCH[-pre][+build]``; raise ValueError otherwise."""
    m = _SEMVER.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is not a semantic version (MAJOR.MINOR.PATCH)")
    return int(m[1]), int(m[2]), int(m[3]), m[4] or ""


def semver_key(text: str) -> tuple[int, int, int, int, str]:
    """Sort key: a pre-release sorts before its release."""
    major, minor, patch, pre = parse_semver(text)
    return (major, minor, patch, 0 if pre else 1, pre)


@dataclass(frozen=True)
class RuntimeCapabilities:
    runtime_version: str
    format_major: int = FORMAT_MAJOR
    quantization_schema_versions: frozenset[int] = frozenset({1})
    operator_set_versions: frozenset[int] = frozenset({1})
    operators: Mapping[str, int] = field(default_factory=dict)  # name -> highest version
    encodings: frozenset[int] = frozenset(int(e) for e in Encoding)
    features: frozenset[str] = frozenset()


@dataclass(frozen=True)
class CompatibilityProblem:
    code: str  # stable identifier, e.g. "runtime_too_old"
    message: str
    remedy: str

    def __str__(self) -> str:
        return f"{self.message}; {self.remedy}"


@dataclass(frozen=True)
class CompatibilityVerdict:
    problems: tuple[CompatibilityProblem, ...] = ()

    @property
    def compatible(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.compatible

    def summary(self) -> str:
        if self.compatible:
            return "compatible"
        return "incompatible: " + " | ".join(str(p) for p in self.problems)


def check_compatibility(header: Header, caps: RuntimeCapabilities) -> CompatibilityVerdict:
    problems: list[CompatibilityProblem] = []
    update = "update the app to a newer edgepack runtime, or fetch a package built for this one"

    def add(code: str, message: str, remedy: str = update) -> None:
        problems.append(CompatibilityProblem(code, message, remedy))

    if header.format_version != caps.format_major:
        add(
            "format_version",
            f"package format {header.format_version}, runtime reads {caps.format_major}",
        )
    try:
        needed = semver_key(header.min_runtime_version)
    except ValueError:
        add(
            "bad_min_runtime_version",
            f"min_runtime_version {header.min_runtime_version!r} is not a semantic version",
            "rebuild the package with a valid --min-runtime-version",
        )
    else:
        if needed > semver_key(caps.runtime_version):
            add(
                "runtime_too_old",
                f"package needs runtime >= {header.min_runtime_version}, "
                f"this runtime is {caps.runtime_version}",
            )
    if header.quantization_schema_version not in caps.quantization_schema_versions:
        add(
            "quantization_schema",
            f"quantization schema version "
            f"{header.quantization_schema_version} is not supported (supported: "
            f"{sorted(caps.quantization_schema_versions)})",
        )
    if header.operator_set_version not in caps.operator_set_versions:
        add(
            "operator_set",
            f"operator set version {header.operator_set_version} is not "
            f"supported (supported: {sorted(caps.operator_set_versions)})",
        )
    for name, version in header.required_operators:
        have = caps.operators.get(name)
        if have is None:
            add("missing_operator", f"operator {name}@{version} is not implemented by this runtime")
        elif have < version:
            add("operator_too_old", f"operator {name}@{version} needed, runtime has {name}@{have}")
    missing_enc = sorted({int(t.encoding) for t in header.tensors} - set(caps.encodings))
    if missing_enc:
        add("encoding", f"tensor encodings {missing_enc} are not supported")
    for feature in header.required_features:
        if feature not in caps.features:
            add("feature", f"required feature {feature!r} is not supported")
    return CompatibilityVerdict(tuple(problems))
