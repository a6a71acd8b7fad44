"""The decoder on tiny random Llama-family models against transformers (torch CPU), every
encoding, KV cache consistency, prefix sharing, determinism, fallbacks and open checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import convert_to, cosine, hf_logits, repack, tiny_model_dir

import edgepack.runtime_shim as rt
from edgepack.format import (
    Encoding,
    IncompatiblePackageError,
    Package,
    PackageWriter,
    SignatureError,
    generate_keypair,
    load_private_key,
    load_public_key,
)
from edgepack.runtime_shim.kernels import QuantizedActivations

pytest.importorskip("transformers")

IDS = [int(i) for i in np.random.default_rng(0).integers(0, 288, 80)]

VARIANTS = {
    "llama-gqa": {},
    "qwen2-bias": {"model_type": "qwen2", "attention_bias": True},
    "tied": {"tie_word_embeddings": True},
    "llama3-rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    "linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "mha-theta": {"num_key_value_heads": 4, "rope_theta": 500000.0},
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runtime-model")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_f32_logits_match_transformers(root: Path, variant: str) -> None:
    src = tiny_model_dir(root, **VARIANTS[variant])
    pkg = convert_to(root, src, "f32")
    ref = hf_logits(src, IDS)
    with rt.open(pkg, kv="float", kernels="numpy") as model:
        ours = model.logits(IDS)
    assert ours.shape == ref.shape == (len(IDS), 288)
    assert np.abs(ours - ref).max() < 1e-4


def test_rope_scaling_is_applied(root: Path) -> None:
    plain = hf_logits(tiny_model_dir(root), IDS)
    scaled = hf_logits(tiny_model_dir(root, **VARIANTS["llama3-rope"]), IDS)
    assert np.abs(plain - scaled).max() > 1e-2  # the variant test above is not vacuous


def test_unsupported_rope_type_is_refused_at_open(root: Path) -> None:
    """Refused at convert (tests/runtime_shim/test_runtime_configs.py), and at open when
    an older packager wrote it anyway."""
    plain = convert_to(root, tiny_model_dir(root), "f32")
    pkg = repack(plain, root / "lr.epk", rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(IncompatiblePackageError, match="longrope"):
        rt.open(pkg)


ENCODINGS = ["f16", "bf16", "int8", "int4-g32", "int4-g32-asym"]
if hasattr(Encoding, "INT3_GROUP_SYM"):  # narrower group codes, where the format has them
    ENCODINGS += ["int3-g32", "int2-g32-asym"]


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("kv", ["float", "int8"])
def test_every_encoding_runs_close_to_f32(root: Path, encoding: str, kv: str) -> None:
    src = tiny_model_dir(root)
    with rt.open(convert_to(root, src, "f32"), kv="float", kernels="numpy") as m:
        ref = m.logits(IDS)
    with rt.open(convert_to(root, src, encoding), kv=kv, kernels="numpy") as m:
        assert m.act_int8 == encoding.startswith("int")
        out = m.logits(IDS)
    # random weights amplify quantization noise; exactness is checked below
    bar = {"f16": 0.99999, "bf16": 0.9999, "int8": 0.999}.get(encoding, 0.9)
    if encoding.startswith("int3"):
        bar = 0.5  # runs and is correlated; exactness below
    elif encoding.startswith("int2"):
        bar = 0.0  # 2-bit random weights: only finite output; exactness below
    if kv == "int8":
        bar = min(bar, 0.97)
    assert np.isfinite(out).all() and cosine(ref, out) > bar


def _dequantized_copy(src: Path, out: Path) -> Path:
    """The same model with every tensor decoded to f32 (spec codecs)."""
    with Package.open(src) as pkg:
        ops = [op for op in pkg.header.required_operators if not op[0].startswith("decode.")]
        with PackageWriter(
            out, pkg.header.identity, required_operators=[*ops, ("decode.f32", 1)]
        ) as wr:
            for t in pkg.header.tensors:
                wr.add_tensor(t.name, Encoding.F32, pkg.dequantize(t.name))
            wr.finish()
    return out


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_float_path_equals_decoded_weights(root: Path, encoding: str) -> None:
    """Float activations over encoded weights == f32 weights decoded by the spec codecs."""
    pkg = convert_to(root, tiny_model_dir(root), encoding)
    ref_pkg = _dequantized_copy(pkg, root / f"decoded-{encoding}.epk")
    with rt.open(ref_pkg, kv="float", kernels="numpy") as m:
        ref = m.logits(IDS)
    with rt.open(pkg, kv="float", kernels="numpy", activations="float") as m:
        out = m.logits(IDS)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_low_rank_weights(root: Path) -> None:
    """A LOW_RANK tensor (U int8 @ V f32) computes U(Vx)."""
    src = convert_to(root, tiny_model_dir(root), "f32")
    out = root / "lowrank.epk"
    name = "layers.1.ffn_up.weight"
    with Package.open(src) as pkg:
        w = pkg.dequantize(name)
        u, s, vt = np.linalg.svd(w.astype(np.float64), full_matrices=False)
        rank = len(s)
        uf = (u * s).astype(np.float32)
        vf = vt.astype(np.float32)
        from edgepack.format import codecs

        with PackageWriter(
            out,
            pkg.header.identity,
            required_operators=[*pkg.header.required_operators, ("decode.low_rank", 1)],
        ) as wr:
            for t in pkg.header.tensors:
                if t.name == name:
                    codes, scales = codecs.quantize_int8_channel(uf)
                    wr.add_tensor(name + ".u", Encoding.INT8_CHANNEL, codes, scales)
                    wr.add_tensor(name + ".v", Encoding.F32, vf)
                    wr.add_low_rank(name, w.shape, (name + ".u", name + ".v"), rank)
                else:
                    wr.add_tensor(t.name, Encoding.F32, pkg.dequantize(t.name))
            wr.finish()
    with rt.open(src, kv="float", kernels="numpy") as m:
        ref = m.logits(IDS)
    with rt.open(out, kv="float", kernels="numpy", activations="float") as m:
        got = m.logits(IDS)
    assert cosine(ref, got) > 0.9999


@pytest.mark.parametrize("kv", ["float", "int8"])
def test_incremental_decode_matches_one_pass(root: Path, kv: str) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "int8")
    with rt.open(pkg, kv=kv, kernels="numpy", kv_block_size=8) as m:
        full = m.logits(IDS[:30])
        seq = m.new_sequence()
        m.forward(seq, IDS[:11], logits="none")
        steps = [m.forward(seq, [t]) for t in IDS[11:30]]
        np.testing.assert_allclose(np.stack(steps), full[11:30], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_matches(root: Path) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "f32")
    with rt.open(pkg, kv="float", kernels="numpy") as m:
        one = m.logits(IDS)
    with rt.open(pkg, kv="float", kernels="numpy", prefill_chunk=16) as m:
        chunked = m.logits(IDS)
    np.testing.assert_allclose(chunked, one, rtol=1e-5, atol=1e-5)


def test_logits_are_bit_identical_across_runs(root: Path) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "int4-g32")
    runs = []
    for _ in range(3):
        with rt.open(pkg, kernels="numpy") as m:
            runs.append(m.logits(IDS).tobytes())
    assert runs[0] == runs[1] == runs[2]


def test_generation_reuses_session_and_shared_prefix(root: Path) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "int8")
    # float activations: int8 ones may round differently when the prompt is split at
    # another token (a 1e-6 change can move an activation code by one step)
    opts = {"kv": "float", "kernels": "numpy", "activations": "float"}
    with rt.open(pkg, kv_block_size=8, **opts) as m:
        a = m.session()
        first = list(a.generate(IDS[:40], max_tokens=5))
        assert a.stats.cached_prompt_tokens == 0 and a.stats.generated_tokens == 5
        # same session, longer prompt: the whole previous context is reused
        again = list(a.generate(IDS[:40] + first[:3], max_tokens=2))
        assert a.stats.cached_prompt_tokens == 42  # all but the one token left to compute
        assert again[:1] == first[3:4]
        # another session: full blocks of the prompt come from the prefix cache
        b = m.session()
        other = list(b.generate(IDS[:40], max_tokens=5))
        assert b.stats.cached_prompt_tokens == 32
        assert other == first
        assert m.kv_pool.stats.prefix_hit_tokens >= 32
        a.close()
        b.close()
        assert m.kv_pool.used_blocks == 0


def test_sampling_is_seeded(root: Path) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "int8")
    with rt.open(pkg, kernels="numpy") as m:
        kw = {"max_tokens": 12, "temperature": 1.0, "top_k": 50, "top_p": 0.9}
        x = list(m.session().generate(IDS[:10], seed=3, **kw))
        y = list(m.session().generate(IDS[:10], seed=3, **kw))
        z = list(m.session().generate(IDS[:10], seed=4, **kw))
        assert x == y and x != z
        s = m.session()
        out = list(s.generate(IDS[:10], max_tokens=20, stop=[x[0]]))
        assert s.stats.finish_reason in ("eos", "length") or out == []


def test_injected_overflow_recomputes_layer_in_float(root: Path) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "int8")
    with rt.open(pkg, kernels="numpy", activations="float") as m:
        ref = m.session().hidden_states(IDS)
    with rt.open(pkg, kernels="numpy") as m:
        plain = m.session().hidden_states(IDS)
        m.inject_overflow_layers = {0, 1}
        s = m.session()
        hit = s.hidden_states(IDS)
        assert s.forward_stats.precision_fallbacks == 2
        assert dict(s.forward_stats.fallback_layers) == {0: 1, 1: 1}
        assert s.forward_stats.fallback_reasons == {
            "activation scale overflow (attention input)": 2
        }
    # every layer fell back: the hidden states are the float-activation path's
    np.testing.assert_allclose(hit["norm"], ref["norm"], rtol=1e-5, atol=1e-5)
    assert cosine(hit["logits"], ref["logits"]) > 0.999
    assert cosine(plain["logits"], ref["logits"]) > 0.99


def test_injected_overflow_via_environment(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "int4-g32")
    monkeypatch.setenv("EDGEPACK_INJECT_OVERFLOW", "1")
    with rt.open(pkg, kernels="numpy") as m:
        s = m.session()
        list(s.generate(IDS[:20], max_tokens=3))
        assert s.stats.precision_fallbacks == 3  # prefill + 2 decode steps, layer 1 each
        assert s.forward_stats.fallback_layers == {1: 3}


def test_nan_in_layer_output_falls_back(root: Path) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "int8")
    with rt.open(pkg, kernels="numpy") as m:
        ref = m.logits(IDS)  # nothing poisoned
        real = m.kernels.matmul
        down = m.weights.layers[1].down

        def poisoned(x, w, residual=None):
            out = real(x, w, residual)
            if w is down and isinstance(x, QuantizedActivations):
                out[0, 0] = np.nan  # only the int8-activation path is broken
            return out

        m.kernels.matmul = poisoned
        s = m.session()
        got = s.logits(IDS)
        assert s.forward_stats.fallback_reasons == {"non-finite layer output": 1}
    assert np.isfinite(got).all() and cosine(got, ref) > 0.99


# -- open -------------------------------------------------------------------------------------
def test_signature_checks(root: Path) -> None:
    from edgepack.packager.convert import convert

    src = tiny_model_dir(root)
    k1, p1 = generate_keypair(root / "release")
    _, p2 = generate_keypair(root / "stranger")
    signed = root / "signed.epk"
    convert(src, signed, encoding="int8", signing_keys=[load_private_key(k1)])
    for verify in ("signature", "full"):
        with rt.open(signed, trusted_keys=[p1], verify=verify) as m:
            assert m.logits(IDS[:4]).shape == (4, 288)
    with rt.open(signed, trusted_keys=[load_public_key(p1)]):
        pass
    with pytest.raises(SignatureError):
        rt.open(signed, trusted_keys=[p2])
    unsigned = convert_to(root, src, "int8")
    with pytest.raises(SignatureError, match="not signed"):
        rt.open(unsigned, trusted_keys=[p1])
    with pytest.raises(ValueError):
        rt.open(unsigned, trusted_keys=[p1], verify="none")


def test_full_verification_reads_every_tensor(root: Path) -> None:
    from edgepack.format import CorruptPackageError

    pkg = convert_to(root, tiny_model_dir(root), "int8")
    data = bytearray(pkg.read_bytes())
    with Package.open(pkg) as p:
        span = p.entry("layers.1.ffn_down.weight").codes
    data[span.offset + 5] ^= 0x40
    bad = root / "flipped.epk"
    bad.write_bytes(bytes(data))
    with rt.open(bad, verify="none"):  # O(header): the flip is not read
        pass
    for mode in ("signature", "full"):  # issue 11: the default hashes the weights too
        with pytest.raises(CorruptPackageError, match="ffn_down"):
            rt.open(bad, verify=mode)


def test_incompatible_runtime_is_refused(root: Path) -> None:
    from edgepack.packager.convert import convert

    out = root / "future.epk"
    convert(tiny_model_dir(root), out, encoding="f32", min_runtime_version="99.0.0")
    with pytest.raises(IncompatiblePackageError, match=r"runtime >= 99\.0\.0"):
        rt.open(out)


def test_weights_are_views_of_the_mapping(root: Path) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "int4-g32")
    with rt.open(pkg, kernels="numpy") as m:
        lin = m.weights.layers[0].gate
        assert not lin.codes.flags.writeable and not lin.codes.flags.owndata
        assert lin.codes.base is not None


def test_config_json_canonical_keys(root: Path) -> None:
    pkg = convert_to(root, tiny_model_dir(root, **VARIANTS["qwen2-bias"]), "f32")
    with rt.open(pkg, kernels="numpy") as m:
        assert m.config.attention_bias and m.weights.layers[0].q.bias is not None
        assert json.dumps(m.config.rope_scaling) == "null"


def _native_available() -> bool:
    from edgepack import native
    from edgepack.runtime_shim.kernels import NativeKernels

    mod = native.load()
    return mod is not None and NativeKernels(mod, 1).implements_any


NATIVE_ENCODINGS = ["f32", "int8", "int4-g32", "int4-g32-asym"]
if hasattr(Encoding, "INT3_GROUP_SYM"):  # weights native cannot bind stay on numpy
    NATIVE_ENCODINGS.append("int3-g32")


@pytest.mark.skipif(not _native_available(), reason="no native runtime kernels")
@pytest.mark.parametrize("encoding", NATIVE_ENCODINGS)
@pytest.mark.parametrize("kv", ["float", "int8"])
def test_native_model_matches_numpy(root: Path, encoding: str, kv: str) -> None:
    pkg = convert_to(root, tiny_model_dir(root, **VARIANTS["qwen2-bias"]), encoding)
    out = {}
    for kernels in ("numpy", "native"):
        with rt.open(pkg, kv=kv, kernels=kernels) as m:
            assert m.kernel_path.startswith(kernels)
            seq = m.new_sequence()
            prefill = m.forward(seq, IDS[:40], logits="all")
            steps = [m.forward(seq, [t]) for t in IDS[40:48]]
            out[kernels] = np.concatenate([prefill, np.stack(steps)])
    # int8 activations: a one-ulp difference may move an activation code by one step
    assert cosine(out["native"], out["numpy"]) > 0.999
    if encoding == "f32":
        np.testing.assert_allclose(out["native"], out["numpy"], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not _native_available(), reason="no native runtime kernels")
def test_native_injected_overflow_falls_back(root: Path) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "int8")
    with rt.open(pkg, kernels="native") as m:
        m.inject_overflow_layers = {1}
        s = m.session()
        s.logits(IDS[:16])
        assert s.forward_stats.fallback_layers == {1: 1}


def test_running_by_ids_imports_no_text_stack(root: Path) -> None:
    """tokenizers / jinja2 are imported only when text is tokenized or a chat rendered."""
    import subprocess
    import sys

    pkg = convert_to(root, tiny_model_dir(root), "int8")
    code = (
        "import sys, edgepack.runtime_shim as rt\n"
        f"m = rt.open({str(pkg)!r})\n"
        "list(m.session().generate([5, 6, 7], max_tokens=3))\n"
        "m.logits([1, 2, 3])\n"
        "bad = [n for n in ('tokenizers', 'jinja2', 'torch', 'transformers', 'click') "
        "if n in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_session_fork_shares_context(root: Path) -> None:
    pkg = convert_to(root, tiny_model_dir(root), "int8")
    opts = {"kv": "float", "kernels": "numpy", "activations": "float", "kv_block_size": 8}
    with rt.open(pkg, **opts) as m:
        a = m.session()
        list(a.generate(IDS[:21], max_tokens=1))
        b = a.fork()
        assert b.tokens == a.tokens and b.seq.blocks == a.seq.blocks
        x = list(a.generate([*IDS[:21], 3], max_tokens=4))
        y = list(b.generate([*IDS[:21], 3], max_tokens=4))
        assert x == y and m.kv_pool.stats.cow_copies >= 1
        assert a.seq.blocks[-1] != b.seq.blocks[-1]
