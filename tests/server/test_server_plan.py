"""The update-check planner on its own (pure): which release, which way, and why."""

from __future__ import annotations

import dataclasses

import pytest

from edgepack.format.constants import ADAPTER_PLAN_OPERATOR, OPERATOR_SET_VERSION
from edgepack.server.http.planner import plan_update
from edgepack.server.http.schemas import InsufficientStorage, TargetRef, UpdateCheck
from edgepack.server.releases.model import DeltaInfo, ReleaseIndex, ReleaseInfo, Requirements

OPS = {"llama.decoder": 2}


def release(version: str, n: int, *, runtime: str = "0.2.0", rollout_bp: int = 10_000,
            length: int = 1000, deltas: tuple[DeltaInfo, ...] = ()) -> ReleaseInfo:
    return ReleaseInfo(
        path=f"m/beta/m-{version}.epk",
        model="m",
        version=version,
        channel="beta",
        rollout_bp=rollout_bp,
        sha256=f"{n:064x}",
        length=length,
        requirements=Requirements(1, runtime, 1, OPERATOR_SET_VERSION, (("llama.decoder", 2),)),
        deltas=deltas,
    )


def delta(from_: ReleaseInfo, to_n: int, length: int) -> DeltaInfo:
    return DeltaInfo(
        from_.version, from_.sha256, f"m/deltas/{from_.sha256}-{to_n:064x}.epkd",
        f"{to_n + 100:064x}", length,
    )


def check(**fields: object) -> UpdateCheck:
    base: dict[str, object] = {
        "device_id": "d", "runtime_version": "0.2.0", "operators": OPS, "channel": "beta",
        "model": "m", "free_bytes": 10**9, "operator_set_version": OPERATOR_SET_VERSION,
    }
    return UpdateCheck.model_validate({**base, **fields})


V1 = release("1.0.0", 1)


def test_never_goes_down_and_names_what_it_passed_over() -> None:
    v2 = release("1.1.0", 2, rollout_bp=0)
    v3 = release("1.2.0", 3, runtime="0.9.0")
    index = ReleaseIndex([V1, v2, v3])
    plan = plan_update(index, check(installed_sha256=V1.sha256))
    assert plan.plan == "none" and plan.release == "1.0.0"
    assert "1.2.0 needs runtime >= 0.9.0 (this device runs 0.2.0)" in plan.reason
    assert "1.1.0 is rolling out to 0%" in plan.reason
    # a device that already runs the newer 1.1.0 (it was in an earlier cohort) stays
    plan = plan_update(index, check(installed_sha256=v2.sha256))
    assert (plan.plan, plan.release) == ("none", "1.1.0")
    assert "never go down" in plan.reason


def test_cheapest_plan_that_fits() -> None:
    small = release("1.1.0", 2, length=1000, deltas=(delta(V1, 2, 100),))
    index = ReleaseIndex([V1, small])
    plan = plan_update(index, check(installed_sha256=V1.sha256))
    assert (plan.plan, plan.bytes) == ("delta", 100)
    plan = plan_update(index, check(installed_sha256=V1.sha256, free_bytes=1099))
    assert (plan.plan, plan.bytes) == ("full", 1000)  # delta + patched file need 1100
    refused = plan_update(index, check(installed_sha256=V1.sha256, free_bytes=999))
    assert isinstance(refused, InsufficientStorage) and refused.needed_bytes == 1000
    # a delta no smaller than the package is never offered
    big = release("1.1.0", 2, length=1000, deltas=(delta(V1, 2, 1000),))
    plan = plan_update(ReleaseIndex([V1, big]), check(installed_sha256=V1.sha256))
    assert plan.plan == "full"


def test_on_demand_is_asked_only_for_a_known_base_without_a_precomputed_delta() -> None:
    v2 = release("1.1.0", 2)
    asked: list[tuple[str, str]] = []

    def on_demand(base: ReleaseInfo, target: ReleaseInfo) -> TargetRef | None:
        asked.append((base.version, target.version))
        return TargetRef(path="m/deltas/x.epkd", length=10, sha256="e" * 64, kind="delta",
                         signed=False)

    index = ReleaseIndex([V1, v2])
    plan = plan_update(index, check(installed_sha256=V1.sha256), on_demand=on_demand)
    assert plan.plan == "delta" and plan.targets[0].signed is False
    assert plan.targets[1].sha256 == v2.sha256  # the signed hash the output must match
    plan = plan_update(index, check(installed_sha256="f" * 64), on_demand=on_demand)
    assert plan.plan == "full"
    assert asked == [("1.0.0", "1.1.0")]


@pytest.mark.parametrize(
    "fields",
    [{"runtime_version": "1.2"}, {"free_bytes": True}, {"free_bytes": "5"},
     {"operator_set_version": 1.5}, {"model": ""}],
)
def test_request_bounds(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        check(**fields)
    assert check(free_bytes=5.0).free_bytes == 5  # JSON Schema integers may be written 5.0


ADAPTER_OPS = {**OPS, ADAPTER_PLAN_OPERATOR: 1}


def _with_digest(r: ReleaseInfo, digest: str) -> ReleaseInfo:
    return dataclasses.replace(r, weights_digest=digest)


def _adapter_release(n: int, base_digest: str, length: int = 50) -> ReleaseInfo:
    return dataclasses.replace(
        release(f"1.0.{n}-adapter", n, length=length),
        path=f"m/beta/m-adapter-{n}.epk",
        adapter_for=(base_digest,),
    )


def test_adapter_release_for_the_installed_weights_is_planned() -> None:
    base = _with_digest(V1, "ab" * 32)
    ad = _adapter_release(7, "ab" * 32)
    other = _adapter_release(8, "cd" * 32)
    index = ReleaseIndex([base, ad, other])
    assert plan_update(index, check(installed_sha256=base.sha256)).plan == "none"  # no opt-in
    plan = plan_update(index, check(installed_sha256=base.sha256, operators=ADAPTER_OPS))
    assert plan.plan == "adapter" and plan.sha256 == ad.sha256 and plan.bytes == 50
    assert [t.kind for t in plan.targets] == ["adapter"]
    # the device has it: nothing to do; an adapter is never a base to install
    have = plan_update(
        index, check(installed_sha256=base.sha256, adapters=[ad.sha256], operators=ADAPTER_OPS)
    )
    assert have.plan == "none" and have.release == "1.0.0"
    fresh = plan_update(index, check())
    assert fresh.plan == "full" and fresh.sha256 == base.sha256
    tight = plan_update(
        index, check(installed_sha256=base.sha256, free_bytes=10, operators=ADAPTER_OPS)
    )
    assert tight.plan == "none"


def test_base_update_comes_before_an_adapter_of_the_old_weights() -> None:
    old = _with_digest(V1, "ab" * 32)
    new = _with_digest(release("1.1.0", 2), "ef" * 32)
    index = ReleaseIndex([old, new, _adapter_release(7, "ab" * 32)])
    plan = plan_update(index, check(installed_sha256=old.sha256, operators=ADAPTER_OPS))
    assert plan.plan == "full" and plan.sha256 == new.sha256
