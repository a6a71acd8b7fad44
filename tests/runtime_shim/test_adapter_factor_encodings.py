"""LoRA factors are kept in their stored encoding (int8 per row, f16, f32) and the native
layer applies each as the numpy chain does, on the float and the int8-activation path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from adapterfactory import IDS, base_model, make_peft_adapter
from runtime_fixtures import cosine

import edgepack.runtime_shim as rt
from edgepack.format import Encoding, Package, SectionKind
from edgepack.format.adapter import decode_adapter
from edgepack.packager.adapters import pack_adapter
from edgepack.packager.convert import convert

pytest.importorskip("peft")

ENCODINGS = [Encoding.INT8_CHANNEL, Encoding.F16, Encoding.F32]
# f16 B is kept transposed as float32, once (the native up-projection reads int8 or float32)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapter-encodings")


@pytest.fixture(scope="module")
def bases(root: Path) -> dict[str, Path]:
    out = {}
    for enc in ("f32", "int8"):
        out[enc] = root / f"base-{enc}.epk"
        convert(base_model(root), out[enc], encoding=enc)
    return out


@pytest.fixture(scope="module")
def peft_dir(root: Path) -> Path:
    return make_peft_adapter(root, "peft-enc", seed=3).path


def _adapter(root: Path, base: Path, peft_dir: Path, encoding: Encoding) -> Path:
    out = root / f"adapter-{base.stem}-{encoding.info.kind}.epk"
    if not out.exists():
        pack_adapter(base, peft_dir, out, encoding=encoding)
    return out


def _online(base: Path, adapter: Path, kernels: str, activations: str) -> np.ndarray:
    try:
        m = rt.open(base, verify="none", kv="float", kernels=kernels, activations=activations)
    except rt.KernelUnavailableError:
        pytest.skip("no native kernels")
    with m:
        return m.session(adapter=m.load_adapter(adapter)).logits(IDS)


@pytest.mark.parametrize("encoding", ENCODINGS, ids=lambda e: e.info.kind)
def test_native_applies_each_encoding_as_numpy_does(root, bases, peft_dir, encoding):
    apkg = _adapter(root, bases["f32"], peft_dir, encoding)
    numpy = _online(bases["f32"], apkg, "numpy", "float")
    native = _online(bases["f32"], apkg, "native", "float")
    assert np.abs(native - numpy).max() < 1e-3
    apkg8 = _adapter(root, bases["int8"], peft_dir, encoding)
    numpy8 = _online(bases["int8"], apkg8, "numpy", "int8")
    native8 = _online(bases["int8"], apkg8, "native", "int8")
    assert cosine(native8, numpy8) > 0.999


@pytest.mark.parametrize("encoding", ENCODINGS[::2], ids=lambda e: e.info.kind)  # int8, f32
def test_loaded_adapter_holds_its_stored_bytes(root, bases, peft_dir, encoding):
    apkg = _adapter(root, bases["f32"], peft_dir, encoding)
    stored = decode_adapter(Package.open(apkg).section(SectionKind.LORA_ADAPTER))
    with rt.open(bases["f32"], verify="none") as m:
        handle = m.load_adapter(apkg)
    assert handle.nbytes == sum(t.a.nbytes + t.b.nbytes for t in stored.targets)
    pair = next(iter(handle.layers[0].values()))
    assert pair.a.codes.dtype == stored.targets[0].a.codes.dtype  # not widened to float32
    parts = [p for t in handle.adapter.targets for f in (t.a, t.b) for p in f.parts]
    assert all(_owner(p) is None for p in parts)  # no view keeps the payload alive too
    assert handle.adapter.targets[0].b.values().tobytes() == stored.targets[0].b.values().tobytes()


@pytest.mark.parametrize("encoding", ENCODINGS, ids=lambda e: e.info.kind)
def test_loaded_adapter_holds_each_factor_once(root, bases, peft_dir, encoding):
    """Every buffer the handle reaches (its pairs and its adapter's targets), counted
    once, adds up to handle.nbytes: no factor is held twice (as f16 B beside its B^T)."""
    apkg = _adapter(root, bases["f32"], peft_dir, encoding)
    with rt.open(bases["f32"], verify="none") as m:
        handle = m.load_adapter(apkg)
    pairs = [p for ps in handle.layers.values() for p in ps.values()]
    arrays = [x for p in pairs for x in (*p.a.parts, p.b_t, p.b_scales) if x is not None]
    arrays += [p for t in handle.adapter.targets for f in (t.a, t.b) for p in f.parts]
    held = {id(r): r.nbytes for r in map(_root, arrays)}
    assert sum(held.values()) == handle.nbytes


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _owner(a: np.ndarray) -> object:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base


def test_long_prefill_is_the_same_on_any_thread_count(root, bases):
    """Rank 64 over 100 tokens: the up-projection splits its outputs over the pool."""
    peft = make_peft_adapter(root, "peft-r64", seed=4, r=64, alpha=16.0)
    apkg = _adapter(root, bases["f32"], peft.path, Encoding.INT8_CHANNEL)
    ids = [int(i) for i in np.random.default_rng(5).integers(3, 100, 100)]
    out = []
    for threads in (1, 2):
        try:
            m = rt.open(bases["f32"], verify="none", kernels="native", threads=threads)
        except rt.KernelUnavailableError:
            pytest.skip("no native kernels")
        with m:
            out.append(m.session(adapter=m.load_adapter(apkg)).logits(ids))
    np.testing.assert_array_equal(out[0], out[1])


def test_native_layer_names_a_factor_of_the_wrong_shape(root, bases, peft_dir):
    apkg = _adapter(root, bases["f32"], peft_dir, Encoding.INT8_CHANNEL)
    try:
        m = rt.open(bases["f32"], verify="none", kernels="native")
    except rt.KernelUnavailableError:
        pytest.skip("no native kernels")
    with m:
        handle = m.load_adapter(apkg)
        pair = handle.layers[0]["q"]
        handle.layers[0]["q"] = dataclasses.replace(pair, b_t=pair.b_t[:, :-1].copy())
        with pytest.raises(ValueError, match=r"pairs\['q'\]\.b_t must be a contiguous \[4, 64\]"):
            m.session(adapter=handle).logits(IDS)
