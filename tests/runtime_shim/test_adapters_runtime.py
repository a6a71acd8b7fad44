"""LoRA adapters online: PEFT adapters made by ``peft`` on a tiny Llama, applied per
session on one mapped base, against merging them into the weights (offline and PEFT's)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from adapterfactory import IDS, base_model, make_peft_adapter
from runtime_fixtures import cosine

import edgepack.runtime_shim as rt
from edgepack.format import Encoding, Package, SectionKind
from edgepack.format.adapter import decode_adapter, encode_adapter
from edgepack.format.errors import AdapterBaseError, AdapterTargetError
from edgepack.packager.adapters import pack_adapter
from edgepack.packager.adapters_merge import merge_lora
from edgepack.packager.convert import convert

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def base(root: Path) -> Path:
    out = root / "base-f32.epk"
    convert(base_model(root), out, encoding="f32")
    return out


@pytest.fixture(scope="module")
def base_int8(root: Path) -> Path:
    out = root / "base-int8.epk"
    convert(base_model(root), out, encoding="int8")
    return out


@pytest.fixture(scope="module")
def peft_a(root: Path):
    return make_peft_adapter(root, "peft-a", seed=1)


@pytest.fixture(scope="module")
def peft_b(root: Path):
    return make_peft_adapter(root, "peft-b", seed=2, r=8, alpha=4.0, use_rslora=True)


def _adapter_pkg(root: Path, base: Path, peft_dir: Path, encoding=Encoding.INT8_CHANNEL) -> Path:
    out = root / f"{peft_dir.name}-{base.stem}-{encoding.info.kind}.epk"
    if not out.exists():
        pack_adapter(base, peft_dir, out, encoding=encoding)
    return out


def _merged(root: Path, base: Path, adapter: Path) -> Path:
    out = root / f"merged-{adapter.stem}.epk"
    if not out.exists():
        merge_lora(base, adapter, out)
    return out


def _logits(path: Path, **kwargs) -> np.ndarray:
    with rt.open(path, verify="none", kv="float", **kwargs) as m:
        return m.logits(IDS)


@pytest.mark.parametrize("kernels", ["numpy", "native"])
def test_online_matches_merged_on_float_path(root, base, peft_a, kernels):
    apkg = _adapter_pkg(root, base, peft_a.path)
    merged = _logits(_merged(root, base, apkg), kernels=kernels, activations="float")
    try:
        m = rt.open(base, verify="none", kv="float", kernels=kernels, activations="float")
    except rt.KernelUnavailableError:
        pytest.skip("no native kernels")
    with m:
        plain = m.logits(IDS)
        handle = m.load_adapter(apkg)
        online = m.session(adapter=handle).logits(IDS)
    assert np.abs(online - plain).max() > 0.1  # the adapter has an effect
    assert np.abs(online - merged).max() < 1e-3


def test_f32_adapter_matches_peft_merge(root, base, peft_a):
    apkg = _adapter_pkg(root, base, peft_a.path, Encoding.F32)
    with rt.open(base, verify="none", kv="float", activations="float") as m:
        online = m.session(adapter=m.load_adapter(apkg)).logits(IDS)
    assert np.abs(online - peft_a.merged_logits).max() < 1e-3


def test_rslora_and_rank_8_match_peft_merge(root, base, peft_b):
    apkg = _adapter_pkg(root, base, peft_b.path, Encoding.F32)
    assert decode_adapter(Package.open(apkg).section(SectionKind.LORA_ADAPTER)).rank == 8
    with rt.open(base, verify="none", kv="float", activations="float") as m:
        online = m.session(adapter=m.load_adapter(apkg)).logits(IDS)
    assert np.abs(online - peft_b.merged_logits).max() < 1e-3


def test_two_sessions_two_adapters_one_base(root, base, peft_a, peft_b, monkeypatch):
    pa, pb = _adapter_pkg(root, base, peft_a.path), _adapter_pkg(root, base, peft_b.path)
    prompt = IDS[:20]

    def greedy(path: Path) -> list[int]:
        with rt.open(path, verify="none") as m:
            return list(m.generate(prompt, max_tokens=8))

    ref_a, ref_b = greedy(_merged(root, base, pa)), greedy(_merged(root, base, pb))
    assert ref_a != ref_b
    with rt.open(base, verify="none") as m:
        ref_none = list(m.generate(prompt, max_tokens=8))
        codes = [lin.codes for layer in m.weights.layers for lin in layer.linears]
        opened: list[str] = []
        real_open = Package.open.__func__

        def counting_open(cls, path, **kw):
            opened.append(str(path))
            return real_open(cls, path, **kw)

        monkeypatch.setattr(Package, "open", classmethod(counting_open))
        ha, hb = m.load_adapter(pa), m.load_adapter(pb)
        sa, sb, s0 = m.session(adapter=ha), m.session(adapter=hb), m.session()
        out_a = list(sa.generate(prompt, max_tokens=8))
        out_b = list(sb.generate(prompt, max_tokens=8))
        out_0 = list(s0.generate(prompt, max_tokens=8))
        sa.use_adapter(hb)
        out_ab = list(sa.generate(prompt, max_tokens=8))
        assert str(base) not in opened  # the base is never opened again
        assert opened == [str(pa), str(pb)]
        after = [lin.codes for layer in m.weights.layers for lin in layer.linears]
        assert all(x is y for x, y in zip(codes, after, strict=True))  # nor copied
    assert out_a == ref_a and out_b == ref_b and out_0 == ref_none
    assert out_ab == ref_b


def test_prefix_cache_is_not_shared_across_adapters(root, base, peft_a):
    apkg = _adapter_pkg(root, base, peft_a.path)
    prompt = IDS[:36]  # two full KV blocks of 16
    with rt.open(base, verify="none") as m:
        h = m.load_adapter(apkg)
        list(m.session().generate(prompt, max_tokens=1))
        hits = m.kv_pool.stats.prefix_hit_tokens
        list(m.session(adapter=h).generate(prompt, max_tokens=1))
        assert m.kv_pool.stats.prefix_hit_tokens == hits  # base blocks not reused
        list(m.session(adapter=h).generate(prompt, max_tokens=1))
        assert m.kv_pool.stats.prefix_hit_tokens == hits + 32  # same adapter: reused
        list(m.session(adapter=h, adapter_scale=0.5).generate(prompt, max_tokens=1))
        assert m.kv_pool.stats.prefix_hit_tokens == hits + 32  # another scale: not


def test_int8_activation_path(root, base_int8, peft_a):
    apkg = _adapter_pkg(root, base_int8, peft_a.path)
    merged = _merged(root, base_int8, apkg)
    for kernels in ("numpy", "native"):
        try:
            m = rt.open(base_int8, verify="none", kernels=kernels, activations="int8")
        except rt.KernelUnavailableError:
            continue
        with m:
            plain = m.logits(IDS)
            online = m.session(adapter=m.load_adapter(apkg)).logits(IDS)
        ref = _logits(merged, kernels=kernels, activations="float")
        assert cosine(online, ref) > 0.99
        assert cosine(online, ref) > cosine(plain, ref)


def test_scale_zero_is_the_base(root, base, peft_a):
    apkg = _adapter_pkg(root, base, peft_a.path)
    with rt.open(base, verify="none", kv="float", activations="float") as m:
        plain = m.logits(IDS)
        zero = m.session(adapter=m.load_adapter(apkg), adapter_scale=0.0).logits(IDS)
    np.testing.assert_allclose(zero, plain, atol=1e-5)


def test_adapter_for_another_base_is_refused(root, base, base_int8, peft_a):
    apkg = _adapter_pkg(root, base, peft_a.path)
    with rt.open(base_int8, verify="none") as m, pytest.raises(AdapterBaseError) as err:
        m.load_adapter(apkg)
    ours = Package.open(base).weights_digest.hex()[:12]
    theirs = Package.open(base_int8).weights_digest.hex()[:12]
    assert ours in str(err.value) and theirs in str(err.value)


def test_adapter_matching_no_tensor_is_refused(root, base, peft_a, tmp_path):
    from edgepack.packager.adapters import write_adapter_package

    payload = Package.open(_adapter_pkg(root, base, peft_a.path)).section(SectionKind.LORA_ADAPTER)
    adapter = decode_adapter(payload)
    renamed = tuple(
        dataclasses.replace(t, name=t.name.replace("layers.", "model.layers."))
        for t in adapter.targets
    )
    bad = encode_adapter(dataclasses.replace(adapter, targets=renamed))
    with Package.open(base) as b:
        out = write_adapter_package(tmp_path / "bad.epk", b, [bad])
    with rt.open(base, verify="none") as m, pytest.raises(AdapterTargetError) as err:
        m.load_adapter(out)
    assert "targets no tensor" in str(err.value) and "model.layers.0." in str(err.value)
