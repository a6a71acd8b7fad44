"""The update-check wire format: pydantic models, every string and list bounded.

These models are the contract other teams' clients rely on (and the OpenAPI document
is generated from them): request fields ``device_id``, ``installed_sha256``,
``runtime_version``, ``operator_set_version``, ``operators``, ``channel``, ``model``,
``adapters``, ``free_bytes``; answer fields ``plan``, ``release``, ``bytes``,
``sha256``, ``targets``, ``reason``. Unknown request fields are refused (422) so a
typo is not silently ignored; integers are JSON Schema integers (``3`` or ``3.0``,
never ``"3"`` or ``false``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from edgepack.format import compat

__all__ = [
    "MAX_ADAPTERS",
    "MAX_OPERATORS",
    "InsufficientStorage",
    "Plan",
    "TargetRef",
    "UpdateCheck",
    "UpdatePlan",
]

MAX_OPERATORS = 512
MAX_ADAPTERS = 64
Plan = Literal["none", "adapter", "delta", "full"]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$", min_length=64, max_length=64)]
Name = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", min_length=1, max_length=128)
]
# the format's own semantic-version grammar, so the document says what parse_semver takes
Semver = Annotated[
    str, StringConstraints(min_length=5, max_length=160, pattern=compat._SEMVER.pattern)
]
OperatorName = Annotated[str, StringConstraints(min_length=1, max_length=128)]


def _json_integer(value: object) -> object:
    """What JSON Schema calls an integer: a number with no fractional part."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be an integer")
        return int(value)
    return value


Int32 = Annotated[int, Field(ge=0, le=2**31 - 1), BeforeValidator(_json_integer)]
OperatorVersion = Int32
AdapterId = Annotated[str, StringConstraints(min_length=1, max_length=128)]
MAX_BYTES = 2**53 - 1  # exact in every JSON parser (doubles), 8 PiB


class UpdateCheck(BaseModel):
    """What a device says about itself."""

    model_config = ConfigDict(extra="forbid")

    device_id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    installed_sha256: Sha256 | None = None
    runtime_version: Semver
    operator_set_version: Int32
    operators: Annotated[dict[OperatorName, OperatorVersion], Field(max_length=MAX_OPERATORS)] = {}
    channel: Name
    model: Name
    adapters: Annotated[list[AdapterId], Field(max_length=MAX_ADAPTERS)] = []
    free_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES), BeforeValidator(_json_integer)]


class TargetRef(BaseModel):
    """A TUF target path with the size and hash the client verifies.

    ``kind`` says what it is for: ``delta`` is downloaded and applied to the installed
    package; ``package`` is the release itself, downloaded by a ``full`` plan and, in a
    ``delta`` plan, the signed target the patched file must equal (its metadata is
    fetched, not its bytes). An on-demand delta (``signed`` false) is not in the TUF
    metadata: only its output is verified, against the package target.
    """

    path: Annotated[str, StringConstraints(max_length=1024)]
    length: Annotated[int, Field(ge=0, le=MAX_BYTES)]
    sha256: Sha256
    kind: Literal["package", "delta", "adapter"]
    signed: bool = True


class UpdatePlan(BaseModel):
    """The cheapest safe plan. ``bytes`` is what the device downloads; ``sha256`` is
    the TUF-signed hash of the package it ends up with (null for ``none`` when nothing
    is installed)."""

    plan: Plan
    release: Annotated[str, StringConstraints(max_length=160)] | None = None
    bytes: Annotated[int, Field(ge=0, le=MAX_BYTES)] = 0
    sha256: Sha256 | None = None
    targets: Annotated[list[TargetRef], Field(max_length=8)] = []
    reason: Annotated[str, StringConstraints(max_length=4096)]


class InsufficientStorage(BaseModel):
    """HTTP 409 answer: the device cannot hold the cheapest download (and the file it
    produces). Nothing to fetch until it frees ``needed_bytes - free_bytes``."""

    error: Literal["insufficient_storage"] = "insufficient_storage"
    release: Annotated[str, StringConstraints(max_length=160)]
    needed_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES)]
    free_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES)]
    reason: Annotated[str, StringConstraints(max_length=4096)]
