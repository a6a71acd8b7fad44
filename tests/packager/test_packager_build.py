"""Calibration capture, the build pipeline and evaluation on tiny synthetic models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import calibration_text, convert_to, eval_text

import edgepack.runtime_shim as rt
from edgepack.format import Package, SectionKind
from edgepack.packager.build import build
from edgepack.packager.calibration import (
    calibration_texts,
    collect_statistics,
    make_samples,
    site_of,
)
from edgepack.packager.errors import CalibrationError
from edgepack.packager.evaluate import evaluate
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)
from edgepack.packager.recipe import parse_recipe

SPEC = TinyLlamaSpec(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=288,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("build")


@pytest.fixture(scope="module")
def gguf(root: Path) -> Path:
    w = tiny_llama_weights(SPEC)
    w.pop("lm_head.weight", None)
    path = root / "tiny.gguf"
    write_gguf_llama(path, SPEC, w)
    return path


@pytest.fixture(scope="module")
def f32(root: Path, gguf: Path) -> Path:
    return convert_to(root, gguf, "f32", name="tiny-f32.epk")


# ---------------------------------------------------------------- samples
def test_make_samples_mixed_lengths_deterministic() -> None:
    docs = [list(range(1000)), list(range(5000, 5300))]
    a = make_samples(docs, 40, 8, 64, seed=1)
    b = make_samples(docs, 40, 8, 64, seed=1)
    assert a == b and len(a) == 40
    lengths = [len(s) for s in a]
    assert min(lengths) >= 8 and max(lengths) <= 64 and len(set(lengths)) > 5
    for s in a:  # a window is a contiguous run of one document
        assert np.all(np.diff(s) == 1)
    assert make_samples(docs, 40, 8, 64, seed=2) != a


def test_make_samples_short_text_and_bos() -> None:
    s = make_samples([list(range(100))], 50, 8, 32, bos=7)
    assert sum(len(x) for x in s) <= 100 + len(s)
    assert all(x[0] == 7 for x in s)
    with pytest.raises(ValueError):
        make_samples([[1]], 4, 8, 32)


def test_calibration_texts_jsonl(tmp_path: Path) -> None:
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "a b"}\n\n"plain"\n{"body": "c", "n": 1}\n')
    assert calibration_texts(p) == ["a b", "plain", "c"]
    (tmp_path / "c.txt").write_text("whole file")
    assert calibration_texts(tmp_path / "c.txt") == ["whole file"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{nope\n")
    with pytest.raises(CalibrationError, match="line 1"):
        calibration_texts(bad)


def test_site_names() -> None:
    assert site_of("layers.3.attn_k.weight") == "layers.3.attn_q.weight"
    assert site_of("layers.3.ffn_up.weight") == "layers.3.ffn_gate.weight"
    assert site_of("layers.3.ffn_down.weight") == "layers.3.ffn_down.weight"
    assert site_of("output.weight") == "output.weight"


# ---------------------------------------------------------------- capture
def test_capture_matches_direct_computation(f32: Path) -> None:
    rng = np.random.default_rng(0)
    samples = [list(rng.integers(0, 288, n)) for n in (5, 17, 33)]
    stats = collect_statistics(f32, samples)
    assert stats.tokens == 55 and stats.samples == 3
    # 2 layers x 4 sites + the (tied) head
    assert sorted(stats.sites) == sorted(
        [
            f"layers.{i}.{k}.weight"
            for i in range(2)
            for k in ("attn_q", "attn_o", "ffn_gate", "ffn_down")
        ]
        + ["embed.weight"]
    )
    with Package.open(f32) as pkg:
        emb = pkg.dequantize("embed.weight")
        norm_w = pkg.dequantize("layers.0.attn_norm.weight")
    xs = []
    for ids in samples:
        x = emb[np.asarray(ids)]
        r = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + SPEC.rms_norm_eps)
        xs.append(norm_w * (x * r))
    x = np.concatenate(xs).astype(np.float64)
    site = stats.sites["layers.0.attn_q.weight"]
    np.testing.assert_allclose(site.hessian, x.T @ x, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(site.abs_max, np.abs(x).max(axis=0), rtol=1e-5)
    assert site.tokens == 55 and site.sample.shape == (55, 64)
    assert stats.sites["embed.weight"].tokens == 55
    assert stats.token_counts.sum() == 55
    assert set(stats.residual_energy) >= {"embed", "layers.0", "layers.1"}


# ---------------------------------------------------------------- build
def _recipe(**search) -> dict:
    return {
        "quantize": {"encodings": ["int4", "int3", "int2-asym", "int8"], "group_sizes": [32]},
        "calibration": {"samples": 24, "min_tokens": 8, "max_tokens": 48},
        "search": search,
    }


def test_build_end_to_end(root: Path, gguf: Path, f32: Path) -> None:
    out = root / "mixed.epk"
    size = 100_000
    data = _recipe(target_size=size)
    data["protect"] = {"layers\\.0\\.attn_v\\.weight": "int8"}
    result = build(gguf, out, parse_recipe(data))
    assert out.stat().st_size == result.nbytes <= size
    assert result.plan.choices["layers.0.attn_v.weight"].label == "int8"
    assert result.report_path.exists() and "## Tensors" in result.report_path.read_text()
    assert result.plot_path is None or result.plot_path.exists()
    assert result.plan.objective <= result.plan.notes["greedy_objective"] * (1 + 1e-12)
    labels = {o.label for o in result.plan.choices.values()}
    assert len(labels - {"f32"}) >= 2, labels  # a real mix at this budget
    with Package.open(out) as pkg:
        plan = json.loads(pkg.section(SectionKind.PRECISION_PLAN))
        calib = json.loads(pkg.section(SectionKind.CALIBRATION_REPORT))
        assert plan["method"] == "search" and plan["search"]["method"].startswith("knapsack")
        entry = plan["tensors"]["layers.1.ffn_down.weight"]
        assert {"encoding", "predicted_error", "measured_error", "options", "proxies"} <= set(entry)
        assert {"hessian_trace", "kurtosis", "outlier_ratio"} <= set(entry["proxies"])
        assert calib["samples"] == 24
        for name, opt in result.plan.choices.items():
            assert pkg.entry(name).encoding == opt.choice.encoding
        pkg.verify()
    with rt.open(f32, kv="float", kernels="numpy") as m:
        ref = m.logits([5, 9, 33, 70, 100, 12])
    with rt.open(out, kv="float") as m:
        got = m.logits([5, 9, 33, 70, 100, 12])
    cos = float((ref * got).sum() / np.sqrt((ref * ref).sum() * (got * got).sum()))
    assert cos > 0.9
    assert not list(root.glob(".*.float.epk"))  # the temporary float package is gone


def test_rtn_uniform_build_equals_convert(root: Path, gguf: Path) -> None:
    data = {
        "quantize": {"encodings": ["int4-g32"], "algorithm": "rtn", "scale_search": False},
        "protect": {"embed\\.weight": "int8"},
    }
    out = build(gguf, root / "rtn.epk", parse_recipe(data), report=False).path
    conv = convert_to(root, gguf, "int4-g32")
    with Package.open(out) as a, Package.open(conv) as b:
        for t in b.header.tensors:
            ea, eb = a.entry(t.name), b.entry(t.name)
            assert ea.encoding == eb.encoding and ea.hash == eb.hash, t.name


def test_build_stores_the_recipe_prefixes(root: Path, gguf: Path) -> None:
    """The recipe's [[prefixes]] are the library's default (not only the CLI's)."""
    data = {
        "quantize": {"encodings": ["int8"], "algorithm": "rtn", "scale_search": False},
        "prefixes": [{"name": "greeting", "text": "Hello there, friend."}],
    }
    out = build(gguf, root / "prefixes.epk", parse_recipe(data), report=False).path
    with rt.open(out, verify="none") as m:
        ((_name, cache),) = m.prefix_store.caches
        assert cache.text == "Hello there, friend."


def test_build_from_float_package_and_budget_errors(root: Path, f32: Path) -> None:
    from edgepack.packager.search import SearchError

    with pytest.raises(SearchError, match="smallest possible"):
        build(f32, root / "tiny-too-small.epk", parse_recipe(_recipe(target_size=20_000)))
    r = build(f32, root / "from-f32.epk", parse_recipe(_recipe(target_bpw=16.0)), report=False)
    assert r.nbytes <= int(16.0 * r.params / 8)
    assert f32.exists()  # a float package given as the source is not consumed


def test_gptq_build_beats_rtn_build(root: Path, gguf: Path, f32: Path) -> None:
    from edgepack.packager.quantizers import output_error
    from edgepack.runtime_shim.tokenizer import Tokenizer

    with Package.open(f32) as pkg:  # held-out text: the error GPTQ minimises, not overfit
        tok = Tokenizer.from_json(pkg.section(SectionKind.TOKENIZER).decode())
    ids = tok.encode(eval_text()[:20000], add_special_tokens=False)
    stats = collect_statistics(f32, make_samples([ids], 16, 32, 64))
    errs = {}
    for algo in ("rtn", "gptq"):
        data = {
            "quantize": {"encodings": ["int3-g32"], "algorithm": algo, "scale_search": False},
            "calibration": {"samples": 32, "min_tokens": 16, "max_tokens": 64},
            "protect": {"embed\\.weight": "int8"},
        }
        path = build(gguf, root / f"{algo}3.epk", parse_recipe(data), report=False).path
        total = 0.0
        with Package.open(path) as q, Package.open(f32) as ref:
            for t in ref.header.tensors:
                if t.name.startswith("layers.") and len(t.shape) == 2:
                    h = stats.site(t.name).mean_hessian
                    total += output_error(q.dequantize(t.name) - ref.dequantize(t.name), h)
        errs[algo] = total
    assert errs["gptq"] < 0.9 * errs["rtn"]


# ---------------------------------------------------------------- eval
def test_eval_protocol(root: Path, f32: Path) -> None:
    text = calibration_text()[:6000]
    res = evaluate(f32, text, ctx=64, chunks=3, ref=f32, kernels="numpy")
    assert res.chunks == 3 and res.tokens == 3 * (64 - 1 - 32)
    assert np.isfinite(res.ppl) and res.ppl > 1
    assert res.kl_mean == pytest.approx(0.0, abs=1e-9) and res.top1 == 1.0
    assert res.ref_ppl == pytest.approx(res.ppl)
    assert res.lines()[0].startswith("PPL ")


def test_eval_cli(root: Path, f32: Path, tmp_path: Path) -> None:
    from edgepack.cli import main

    text = tmp_path / "t.txt"
    text.write_text(calibration_text()[:4000])
    assert main(["eval", str(f32), "--text", str(text), "--ctx", "64", "--chunks", "2"]) == 0
    assert main(["eval", str(f32), "--text", str(text), "--ctx", "2"]) != 0


def test_builds_are_reproducible(root: Path, gguf: Path) -> None:
    """Same source, recipe and calibration text: the same package, byte for byte (no
    clock or machine figure inside), so a release pipeline can rebuild and compare."""
    data = _recipe(target_size=100_000)
    outs = [root / f"repro{i}.epk" for i in range(2)]
    for out in outs:
        build(gguf, out, parse_recipe(data), report=False)
    assert outs[0].read_bytes() == outs[1].read_bytes()
