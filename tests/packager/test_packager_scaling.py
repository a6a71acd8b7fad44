"""AWQ / SmoothQuant scales fold into the previous ops without changing the model, lower
the quantization error they target; whitened SVD factorization and low-rank packages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import convert_to, tiny_model_dir

import edgepack.runtime_shim as rt
from edgepack.format import Encoding, Package, codecs
from edgepack.packager.build import build
from edgepack.packager.encode import parse_encoding
from edgepack.packager.factorize import factorize, rank_for, whitened_svd
from edgepack.packager.quantizers import output_error, rtn_quantize
from edgepack.packager.quantizers.awq import Transforms, awq_scales, scale_sites
from edgepack.packager.quantizers.smoothquant import smooth_scales
from edgepack.packager.recipe import parse_recipe
from edgepack.packager.sensitivity import FakeQuantModel

IDS = [int(i) for i in np.random.default_rng(3).integers(0, 288, 40)]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scaling")


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2-bias"])
def f32(request, root: Path) -> Path:
    kw = {} if request.param == "llama-gqa" else {"model_type": "qwen2", "attention_bias": True}
    return convert_to(root, tiny_model_dir(root, **kw), "f32")


def test_folded_scales_keep_the_function(f32: Path) -> None:
    with rt.open(f32, kv="float", kernels="numpy", activations="float") as model:
        pkg = model.package
        names = [t.name for t in pkg.header.tensors]
        sites = scale_sites(names, pkg.header.identity.config)
        assert {s.site.split(".")[2] for s in sites} == {"attn_q", "ffn_gate", "ffn_down", "attn_o"}
        rng = np.random.default_rng(0)
        tr = Transforms()
        for site in sites:
            k = pkg.entry(site.consumers[0]).shape[1]
            s = np.exp(rng.normal(0, 0.5, k)).astype(np.float32)
            if site.expand is not None:  # GQA: channels of one v row share a scale
                kv, group, hd = site.expand
                s = np.repeat(s.reshape(kv, group, hd)[:, :1], group, axis=1).reshape(-1)
            tr.fold(site, s)
        fq = FakeQuantModel(model)
        ref = fq.log_probs(IDS)
        for name in names:
            if name in tr.cols or name in tr.rows or name in tr.vecs:
                fq.swap(name, tr.apply(name, pkg.dequantize(name)))
        got = fq.log_probs(IDS)
        fq.reset()
        assert np.abs(fq.log_probs(IDS) - ref).max() == 0
    np.testing.assert_allclose(got, ref, atol=2e-3)
    assert np.abs(got - ref).max() > 0  # something really changed


def _site_problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    k = 128
    x = rng.standard_normal((2048, k)).astype(np.float32)
    x[:, :4] *= 20  # salient channels
    w = {"a": (rng.standard_normal((64, k)) * 0.05).astype(np.float32)}
    h = x.T.astype(np.float64) @ x / len(x)
    return w, x, h


def test_awq_never_worse_and_helps_with_salient_channels() -> None:
    from edgepack.packager.quantizers.awq import ScaleSite

    w, x, h = _site_problem()
    site = ScaleSite("a", ("a",), "norm", False)
    choice = parse_encoding("int3-g32")
    s, err, base = awq_scales(site, w, {"a": choice}, h, np.abs(x).mean(axis=0))
    assert err <= base and err < 0.95 * base
    # the error is real: quantize the scaled weight, unscale, measure
    _, q = rtn_quantize(w["a"] * s, choice)
    assert output_error(q / s - w["a"], h) == pytest.approx(err, rel=0.05)


def test_smoothquant_flattens_activations() -> None:
    from edgepack.packager.quantizers.awq import ScaleSite

    w, x, _ = _site_problem(1)
    site = ScaleSite("a", ("a",), "norm", False)
    s = smooth_scales(site, w, np.abs(x).max(axis=0), alpha=0.5)
    before = np.abs(x).max(axis=0)
    after = np.abs(x / s).max(axis=0)
    assert after.max() / np.median(after) < 0.5 * before.max() / np.median(before)
    with pytest.raises(ValueError):
        smooth_scales(site, w, before, alpha=2)


def test_whitened_svd_beats_plain_svd_on_output_error() -> None:
    w, _, h = _site_problem(2)
    m = w["a"]
    _, s, _, _ = whitened_svd(m, h, damp=1e-6)
    r = 16
    lr = factorize(m, h, r, parse_encoding("f32"), gptq=False, damp=1e-6)
    # unquantized factors: the error left is the tail of the whitened spectrum (the
    # least-squares refit of U can only lower it)
    tail = float((s[r:] ** 2).sum())
    assert tail * 0.98 <= lr.error <= tail * 1.001
    u, sv, vt = np.linalg.svd(m, full_matrices=False)
    plain = (u[:, :r] * sv[:r]) @ vt[:r]
    assert lr.error < output_error(plain - m, h)
    assert rank_for(0.25, 64, 128) == 32 and rank_for(0.01, 64, 128) == 32


def test_factorize_quantized_factors_decode_exactly() -> None:
    w, _, h = _site_problem(3)
    choice = parse_encoding("int4-g32")
    lr = factorize(w["a"], h, 32, choice)
    u = codecs.dequantize_group(lr.u.codes, lr.u.scales, lr.u.zeros, 4, 32)
    v = codecs.dequantize_group(lr.v.codes, lr.v.scales, lr.v.zeros, 4, 32)
    np.testing.assert_allclose(u @ v, lr.decoded, rtol=1e-5, atol=1e-6)
    assert lr.u.shape == (64, 32) and lr.v.shape == (32, 128)


def _gguf(root: Path) -> Path:
    """A tiny GGUF with a tokenizer (calibration tokenizes text)."""
    from edgepack.packager.importers.synthetic import (
        TinyLlamaSpec,
        tiny_llama_weights,
        write_gguf_llama,
    )

    path = root / "tiny.gguf"
    if not path.exists():
        spec = TinyLlamaSpec(hidden_size=64, intermediate_size=128, vocab_size=288)
        write_gguf_llama(path, spec, tiny_llama_weights(spec))
    return path


def test_build_with_awq_smoothquant_and_low_rank(root: Path) -> None:
    src = _gguf(root)
    f32 = convert_to(root, src, "f32")
    data = {
        "quantize": {
            "encodings": ["int4-g32", "int3-g32", "int8"],
            "awq": True,
            "smoothquant": 0.5,
        },
        "factorize": {"enabled": True, "ranks": [0.25], "factor_encoding": "int8"},
        "calibration": {"samples": 24, "min_tokens": 8, "max_tokens": 48},
        "search": {"target_bpw": 14.0},
    }
    r = build(src, root / "awq.epk", parse_recipe(data), report=False)
    assert r.scaling and any("awq_error_ratio" in v for v in r.scaling.values())
    ranks = [o.rank for s in r.sensitivities for o in s.options if o.rank]
    assert ranks, "low-rank options were offered"
    # force a low-rank choice and check the runtime runs it
    data["protect"] = {}
    with Package.open(root / "awq.epk") as pkg:
        norm = pkg.dequantize("layers.0.attn_norm.weight")
    with Package.open(f32) as ref:
        assert not np.array_equal(norm, ref.dequantize("layers.0.attn_norm.weight"))
    with rt.open(f32, kv="float", kernels="numpy") as m:
        a = m.logits(IDS)
    with rt.open(root / "awq.epk", kv="float", kernels="numpy", activations="float") as m:
        b = m.logits(IDS)
    cos = float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))
    assert cos > 0.95


def test_low_rank_plan_is_written_and_runs(root: Path) -> None:
    src = _gguf(root)
    data = {
        "quantize": {"encodings": ["int8"], "algorithm": "gptq"},
        "factorize": {"enabled": True, "ranks": [0.25], "factor_encoding": "int8"},
        "calibration": {"samples": 16, "min_tokens": 8, "max_tokens": 32},
    }
    # make low rank the only affordable choice for the FFN weights: tight budget
    probe = build(src, root / "lr-probe.epk", parse_recipe(data), report=False)
    lr_bytes = {
        s.name: min(o.nbytes for o in s.options if o.rank)
        for s in probe.sensitivities
        if any(o.rank for o in s.options)
    }
    assert lr_bytes
    saving = max(
        max(o.nbytes for o in s.options) - lr_bytes[s.name]
        for s in probe.sensitivities
        if s.name in lr_bytes
    )
    data["search"] = {"target_size": probe.nbytes - saving // 2}
    r = build(src, root / "lr.epk", parse_recipe(data), report=False)
    chosen = [n for n, o in r.plan.choices.items() if o.rank]
    assert chosen
    with Package.open(r.path) as pkg:
        e = pkg.entry(chosen[0])
        assert e.encoding == Encoding.LOW_RANK and len(e.factors) == 2
        ops = dict(pkg.header.required_operators)
        assert "decode.low_rank" in ops
    with rt.open(r.path, kv="float", kernels="numpy") as m:
        assert np.isfinite(m.logits(IDS)).all()
