"""RTN and GPTQ produce the format's encodings bit-exact with the codecs' decode, and GPTQ
lowers the output error it is built to minimise."""

from __future__ import annotations

import numpy as np
import pytest

from edgepack.format import codecs
from edgepack.packager.encode import encode_tensor, parse_encoding
from edgepack.packager.quantizers import gptq_quantize, output_error, rtn_quantize
from edgepack.packager.quantizers.rtn import decode, search_params

GROUP_LABELS = [
    "int4-g32",
    "int4-g64-asym",
    "int3-g32",
    "int3-g32-asym",
    "int2-g32-asym",
    "int2-g64",
]


def _problem(rows: int = 48, cols: int = 128, tokens: int = 512, seed: int = 0):
    """Weights and correlated inputs with a few outlier channels (like LLM activations)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    mix = rng.standard_normal((cols, cols)) / np.sqrt(cols)
    x = rng.standard_normal((tokens, cols)) @ mix
    x[:, rng.choice(cols, 4, replace=False)] *= 8
    x = x.astype(np.float32)
    return w, x, (x.T.astype(np.float64) @ x) / tokens


@pytest.mark.parametrize("label", [*GROUP_LABELS, "int8", "f16"])
def test_rtn_is_the_codec(label: str) -> None:
    w, _, _ = _problem()
    choice = parse_encoding(label)
    enc, deq = rtn_quantize(w, choice)
    ref = encode_tensor(w, choice)
    assert np.array_equal(enc.codes, ref.codes)
    for a, b in ((enc.scales, ref.scales), (enc.zeros, ref.zeros)):
        assert (a is None and b is None) or np.array_equal(a, b)
    assert np.array_equal(deq, decode(ref))


@pytest.mark.parametrize("label", GROUP_LABELS)
def test_scale_search_decodes_exactly_and_never_loses(label: str) -> None:
    w, _, h = _problem(seed=1)
    choice = parse_encoding(label)
    hd = np.diag(h)
    enc, deq = rtn_quantize(w, choice, hd, search=True)
    bits = choice.encoding.bits
    assert np.array_equal(
        codecs.dequantize_group(enc.codes, enc.scales, enc.zeros, bits, choice.group_size), deq
    )
    _, plain = rtn_quantize(w, choice)
    werr = lambda d: float(((d - w) ** 2 * hd).sum())  # noqa: E731
    assert werr(deq) <= werr(plain) * (1 + 1e-6)


@pytest.mark.parametrize("label", GROUP_LABELS)
@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_bit_exact_and_better_than_rtn(label: str, act_order: bool) -> None:
    w, _, h = _problem(seed=2)
    choice = parse_encoding(label)
    enc, deq = gptq_quantize(w, h, choice, act_order=act_order, block_size=64)
    bits = choice.encoding.bits
    stored = codecs.dequantize_group(enc.codes, enc.scales, enc.zeros, bits, choice.group_size)
    assert np.array_equal(stored, deq)  # what GPTQ assumed is what the runtime decodes
    _, rtn = rtn_quantize(w, choice)
    assert output_error(deq - w, h) < output_error(rtn - w, h)


def test_gptq_handles_dead_inputs_and_3d_shapes() -> None:
    w, _, h = _problem(rows=16, cols=64, seed=3)
    h[5, :] = h[:, 5] = 0  # an input channel that never fires
    choice = parse_encoding("int4-g32")
    enc, deq = gptq_quantize(w.reshape(16, 2, 32), h, choice)
    assert enc.shape == (16, 2, 32) and deq.shape == (16, 64)
    assert np.all(deq[:, 5] == 0)


def test_gptq_non_group_falls_back_to_rtn() -> None:
    w, _, h = _problem(rows=8, cols=64)
    enc, _ = gptq_quantize(w, h, parse_encoding("int8"))
    ref = encode_tensor(w, parse_encoding("int8"))
    assert np.array_equal(enc.codes, ref.codes)


def test_search_params_orientation_and_refit() -> None:
    # a group whose mass sits on the positive side: the flipped symmetric grid wins
    w = np.array([[1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, -0.1]], np.float32)
    p = search_params(w, 3, 8, True)
    base = search_params(w, 3, 8, True, h=np.ones(8)).d
    assert p.d.dtype == np.float16 and np.array_equal(p.d, base)
    _, plain = rtn_quantize(w, parse_encoding("int3-g8"))
    _, best = rtn_quantize(w, parse_encoding("int3-g8"), search=True)
    assert ((best - w) ** 2).sum() < ((plain - w) ** 2).sum()
