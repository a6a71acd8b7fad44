"""Shared fixtures of the native-kernel tests."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest


def _available_isas() -> list[str]:
    if importlib.util.find_spec("edgepack.native._kernels") is None:
        return []  # the module is absent: tests that need it skip themselves
    from edgepack.native import _kernels

    return list(_kernels.available_isas())


@pytest.fixture(params=_available_isas())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test once per ISA this machine can execute, restoring the active one."""
    from edgepack.native import _kernels

    previous = _kernels.active_isa()
    _kernels.set_isa(request.param)
    try:
        yield request.param
    finally:
        _kernels.set_isa(previous)
