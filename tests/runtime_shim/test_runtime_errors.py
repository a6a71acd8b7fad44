"""One NumericError for both kernel paths; native Status codes arrive typed (issue 10, part 4)."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_fixtures import native_runtime_module, tiny_package

import edgepack.runtime_shim as rt
from edgepack.format.errors import EdgepackError, EncodingError
from edgepack.runtime_shim import NumericError, instrument
from edgepack.runtime_shim.errors import KernelStatus
from edgepack.runtime_shim.kernels import NativeKernels, NumpyKernels
from edgepack.runtime_shim.kv_cache import KVCacheConfig, KVPool


def test_numeric_error_is_public_and_in_the_tree() -> None:
    assert "NumericError" in rt.__all__ and rt.NumericError is NumericError
    err = NumericError("x", KernelStatus.SCALE_OVERFLOW, op="quantize_act", row=1, col=2)
    assert isinstance(err, EdgepackError) and isinstance(err, FloatingPointError)
    assert err.code is KernelStatus.SCALE_OVERFLOW and err.kind == "scale_overflow"
    assert (err.op, err.row, err.col) == ("quantize_act", 1, 2)


def test_kernel_status_mirrors_native_numbering() -> None:
    mod = native_runtime_module()
    assert {s.name.lower(): int(s) for s in KernelStatus} == mod.STATUS_CODES
    assert mod.NumericError is NumericError  # one class, not one created in C++


def _nan_kv_attend(kernels) -> None:
    pool = KVPool(1, 1, 32, KVCacheConfig(block_size=4, budget_bytes=1 << 16))
    seq = pool.sequence()
    seq.prepare([1])
    k = np.full((1, 1, 32), np.nan, np.float32)
    kernels.attend(np.ones((1, 2, 32), np.float32), k, k, pool.layer(0), seq.block_table(1), 0)


@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_both_backends_raise_numeric_error_for_non_finite_kv(backend: str) -> None:
    k = NumpyKernels(1) if backend == "numpy" else NativeKernels(native_runtime_module(), 1)
    try:
        with pytest.raises(NumericError) as info:
            _nan_kv_attend(k)
    finally:
        k.close()
    assert info.value.code == KernelStatus.NON_FINITE
    assert type(info.value) is NumericError


@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_a_model_with_nan_weights_raises_numeric_error_on_both_paths(
    tmp_path_factory: pytest.TempPathFactory, backend: str
) -> None:
    if backend == "native":
        native_runtime_module()
    f32_pkg = tiny_package(tmp_path_factory, "f32")
    with rt.open(f32_pkg, kernels=backend, kv="int8", activations="float", verify="none") as m:
        k = m.weights.layers[0].k
        nan = np.full((k.rows, k.cols), np.nan, np.float32)
        instrument.WeightOverrides(m).set_linear(
            k.name, instrument.make_linear(k.name, k.encoding, (k.rows, k.cols), nan)
        )
        with pytest.raises(NumericError) as info:
            m.logits([1, 2, 3])
    assert info.value.code == KernelStatus.NON_FINITE


def test_native_status_arrives_as_a_typed_error_with_its_code() -> None:
    mod = native_runtime_module()
    x = np.ones((2, 32), np.float32)
    x[1, 5] = np.inf
    with pytest.raises(NumericError) as info:
        mod.quantize_act(x, 32)
    err = info.value
    assert err.code is KernelStatus.NON_FINITE
    assert (err.op, err.row, err.col) == ("quantize_act", 1, 5)
    with pytest.raises(EncodingError) as enc:
        mod.quantize_int4_group(np.full((1, 32), 1e6, np.float32), 32, True)
    assert enc.value.code == KernelStatus.SCALE_OVERFLOW
    with pytest.raises(EncodingError) as enc:
        mod.quantize_int4_group(np.ones((1, 32), np.int32), 32, True)
    assert enc.value.code == KernelStatus.BAD_DTYPE
