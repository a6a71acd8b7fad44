"""One layer chain per language, one fallback enum across the boundary (issue 10, part 3)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import native_runtime_module, tiny_package

import edgepack.runtime_shim as rt
from edgepack.runtime_shim.kernels import Fallback, NativeKernels

REPO = Path(__file__).resolve().parents[2]
IDS = [5, 17, 3, 99, 42, 7, 64, 2, 11]


def test_fallback_enum_mirrors_native() -> None:
    mod = native_runtime_module("FALLBACK_REASONS")
    assert {f.code: f.value for f in Fallback} == mod.FALLBACK_REASONS
    assert len({f.code for f in Fallback}) == len(Fallback)


def test_reason_strings_are_written_once() -> None:
    """No module but the two enum definitions spells a fallback reason."""
    reasons = [f.value for f in Fallback]
    homes = {REPO / "runtime_shim/kernels/fallback.py", REPO / "native/src/infer/fallback.h"}
    sources = [*(REPO / "runtime_shim").rglob("*.py"), *(REPO / "native" / "src").rglob("*.[ch]*")]
    leaks = [
        f"{p.relative_to(REPO)}: {r}"
        for p in sources
        if p not in homes
        for r in reasons
        if re.search(r'"' + re.escape(r) + r'"', p.read_text())
    ]
    assert not leaks


def test_kernels_module_is_a_package_with_the_old_import_paths() -> None:
    from edgepack.runtime_shim import kernels
    from edgepack.runtime_shim.kernels import (  # noqa: F401
        ACT_SCALE_MAX,
        KERNEL_OPS,
        Kernels,
        LayerContext,
        LayerResult,
        NumpyKernels,
        QuantizedActivations,
        select_kernels,
    )

    assert Path(kernels.__file__).name == "__init__.py"
    for module in Path(kernels.__file__).parent.glob("*.py"):
        assert len(module.read_text().splitlines()) < 500, module.name


@pytest.fixture(scope="module")
def int8_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_package(tmp_path_factory, "int8")


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_python_chain_over_native_ops_equals_the_native_layer(
    int8_pkg: Path, activations: str
) -> None:
    """The native backend without its whole-layer entry point runs the shared Python
    chain over its single ops: the same bits as the C++ layer."""
    native_runtime_module("FALLBACK_REASONS")
    out = {}
    for fused in (True, False):
        with rt.open(int8_pkg, kernels="native", activations=activations, verify="none") as m:
            assert isinstance(m.kernels, NativeKernels)
            m.kernels._fused_layer = fused
            out[fused] = m.session().logits(IDS)
    np.testing.assert_array_equal(out[True], out[False])


@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_both_backends_report_fallbacks_as_the_enum(int8_pkg: Path, backend: str) -> None:
    if backend == "native":
        native_runtime_module("FALLBACK_REASONS")
    with rt.open(int8_pkg, kernels=backend, verify="none") as m:
        m.inject_overflow_layers = {1}
        lw = m.weights.layers[1]
        seen = []
        real = m.kernels.decoder_layer

        def spy(layer, x, ctx):
            res = real(layer, x, ctx)
            if layer is lw and ctx.act_int8:
                seen.append(res.fallback)
            return res

        m.kernels.decoder_layer = spy
        s = m.session()
        s.logits(IDS)
    assert seen == [Fallback.ATTENTION_INPUT] and seen[0] is Fallback.ATTENTION_INPUT
    assert s.forward_stats.fallback_reasons == {Fallback.ATTENTION_INPUT.value: 1}
