"""Choose the cheapest safe plan for one device: pure, no I/O.

A release is a candidate when the device is in its rollout cohort
(:func:`edgepack.server.releases.model.in_rollout`, the stable hash of device id and
release) and its recorded requirements pass the same ``check_compatibility`` the device
runs on the header. The newest candidate is the target; the device never goes down (an
installed release newer than the target stays). Among the ways to get the target -
a delta from exactly the installed hash (precomputed, or on demand) or the full
package - the smallest download whose storage need fits ``free_bytes`` wins:

* ``full`` needs the package's length (written into the inactive slot);
* ``delta`` needs the delta's length plus the package's (the patched file is written
  next to the downloaded delta).

When nothing fits, the answer is :class:`InsufficientStorage` (HTTP 409), never a plan
the device cannot finish.

Adapter-only releases (``ReleaseInfo.adapter_for``: the weights digests their LoRA
adapters are bound to) are never a base to install. When the device keeps its release
(up to date, or newer than the target) and an adapter release on the channel is bound to
that release's weights, is compatible, in its cohort, not among the ``adapters`` the
device reports (their sha256) and fits, the plan is ``adapter``: download just it. Only
a device whose client installs adapter plans (it lists ``ADAPTER_PLAN_OPERATOR`` among
its operators) is offered one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from edgepack.format import RuntimeCapabilities
from edgepack.format.constants import ADAPTER_PLAN_OPERATOR

from ..releases.model import ReleaseIndex, ReleaseInfo, semver_precedence
from .schemas import InsufficientStorage, TargetRef, UpdateCheck, UpdatePlan

__all__ = ["OnDemandDelta", "capabilities_of", "plan_update"]

# (base release, target release) -> the stored on-demand delta, or None (not there yet:
# the callee may start computing it)
OnDemandDelta = Callable[[ReleaseInfo, ReleaseInfo], TargetRef | None]


@dataclass(frozen=True)
class _Option:
    plan: str
    download: int
    need: int
    targets: tuple[TargetRef, ...]


def capabilities_of(req: UpdateCheck) -> RuntimeCapabilities:
    """The device's runtime as ``check_compatibility`` sees it (fields the request does
    not carry keep the format's defaults)."""
    return RuntimeCapabilities(
        runtime_version=req.runtime_version,
        operator_set_versions=frozenset({req.operator_set_version}),
        operators=dict(req.operators),
    )


def plan_update(
    index: ReleaseIndex,
    req: UpdateCheck,
    *,
    on_demand: OnDemandDelta | None = None,
) -> UpdatePlan | InsufficientStorage:
    everything = index.releases(req.model, req.channel)
    releases = [r for r in everything if not r.is_adapter]
    adapters = [r for r in everything if r.is_adapter]
    if not releases:
        return UpdatePlan(plan="none", reason=f"no release of {req.model} on {req.channel}")
    caps = capabilities_of(req)
    passed_over: list[str] = []
    target: ReleaseInfo | None = None
    for release in reversed(releases):
        if not release.in_rollout(req.device_id):
            passed_over.append(
                f"{release.version} is rolling out to {release.rollout_percent:g}% of devices "
                "and this one is not in that cohort yet"
            )
            continue
        verdict = release.requirements.check(caps)
        if not verdict:
            passed_over.append(_incompatibility(release, verdict.problems, req))
            continue
        target = release
        break
    installed = _installed(index, req)
    if target is None:
        why = "; ".join(passed_over)
        return UpdatePlan(plan="none", reason=f"no compatible release on {req.channel}: {why}")
    note = f" ({'; '.join(passed_over)})" if passed_over else ""
    newest = f"the newest release on {req.channel} for this device"
    if req.installed_sha256 == target.sha256:
        return _adapter_plan(adapters, target, req, caps) or _stay(
            target, f"up to date: {target.version} is {newest}{note}"
        )
    if installed is not None and semver_precedence(installed.version) > semver_precedence(
        target.version
    ):
        return _adapter_plan(adapters, installed, req, caps) or _stay(
            installed,
            f"installed {installed.version} is newer than {target.version}, {newest} "
            "(versions never go down)",
        )
    options = _options(target, installed, req, on_demand)
    fitting = [o for o in options if o.need <= req.free_bytes]
    if not fitting:
        least = min(options, key=lambda o: o.need)
        return InsufficientStorage(
            release=target.version,
            needed_bytes=least.need,
            free_bytes=req.free_bytes,
            reason=f"{target.version} needs {least.need} bytes of free storage "
            f"({least.plan}), the device has {req.free_bytes}",
        )
    best = min(fitting, key=lambda o: (o.download, o.plan != "delta"))
    if best.plan == "delta":
        how = f"delta from {installed.version if installed else 'the installed package'}"
    elif installed is None and req.installed_sha256:
        how = "full package (the installed package is not a known release)"
    elif req.installed_sha256 is None:
        how = "full package (nothing installed)"
    else:
        how = "full package (no smaller delta from the installed release fits)"
    return UpdatePlan(
        plan=best.plan,  # type: ignore[arg-type]
        release=target.version,
        bytes=best.download,
        sha256=target.sha256,
        targets=list(best.targets),
        reason=f"update to {target.version} on {req.channel}: {how}{note}",
    )


def _adapter_plan(
    adapters: list[ReleaseInfo], kept: ReleaseInfo, req: UpdateCheck, caps: RuntimeCapabilities
) -> UpdatePlan | None:
    """An ``adapter`` plan for the newest adapter release bound to ``kept``'s weights
    that the device lacks and can hold, or None."""
    if not kept.weights_digest or ADAPTER_PLAN_OPERATOR not in req.operators:
        return None
    have = set(req.adapters)
    for a in reversed(adapters):  # newest first
        if (
            kept.weights_digest in a.adapter_for
            and a.sha256 not in have
            and a.in_rollout(req.device_id)
            and a.length <= req.free_bytes
            and a.requirements.check(caps)
        ):
            ref = TargetRef(path=a.path, length=a.length, sha256=a.sha256, kind="adapter")
            return UpdatePlan(
                plan="adapter",
                release=a.version,
                bytes=a.length,
                sha256=a.sha256,
                targets=[ref],
                reason=f"adapter {a.path} for the installed {kept.version} "
                f"(bound to its weights {kept.weights_digest[:12]})",
            )
    return None


def _stay(release: ReleaseInfo, reason: str) -> UpdatePlan:
    """Nothing to do: the device keeps ``release``."""
    return UpdatePlan(plan="none", release=release.version, sha256=release.sha256, reason=reason)


def _installed(index: ReleaseIndex, req: UpdateCheck) -> ReleaseInfo | None:
    if req.installed_sha256 is None:
        return None
    found = [r for r in index.by_sha256(req.installed_sha256) if r.model == req.model]
    return found[-1] if found else None


def _package_ref(release: ReleaseInfo) -> TargetRef:
    return TargetRef(
        path=release.path, length=release.length, sha256=release.sha256, kind="package"
    )


def _options(
    target: ReleaseInfo,
    installed: ReleaseInfo | None,
    req: UpdateCheck,
    on_demand: OnDemandDelta | None,
) -> list[_Option]:
    package = _package_ref(target)
    out = [_Option("full", target.length, target.length, (package,))]
    if req.installed_sha256 is None:
        return out
    delta = target.delta_from(req.installed_sha256)
    ref: TargetRef | None = None
    if delta is not None:
        ref = TargetRef(path=delta.path, length=delta.length, sha256=delta.sha256, kind="delta")
    elif installed is not None and on_demand is not None:
        ref = on_demand(installed, target)
    if ref is not None and ref.length < target.length:
        out.append(_Option("delta", ref.length, ref.length + target.length, (ref, package)))
    return out


def _incompatibility(release: ReleaseInfo, problems: tuple, req: UpdateCheck) -> str:
    parts = []
    for p in problems:
        if p.code == "runtime_too_old":
            parts.append(
                f"{release.version} needs runtime >= {release.requirements.min_runtime_version} "
                f"(this device runs {req.runtime_version})"
            )
        else:
            parts.append(f"{release.version}: {p.message}")
    return "; ".join(parts)
