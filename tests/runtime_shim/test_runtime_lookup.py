"""Prompt-lookup decoding on tiny models: greedy output token for token the same as plain
decoding (drafts accepted and rejected, stops and max_tokens inside a draft, the context
limit, shared and copy-on-write blocks), and the KV sequence left as plain decoding
leaves it. The kernels' batch invariance, which the identity rests on, is tested too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import convert_to, native_runtime_module, tiny_model_dir

import edgepack.runtime_shim as rt
from edgepack.runtime_shim.lookup import (
    DraftIndex,
    LookupDecoder,
    acceptance_counts,
    batch_invariant,
    draft_ends,
    pass_costs,
)

ENCODINGS = ("f32", "int8", "int4-g32")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lookup")
    src = tiny_model_dir(root)
    return {enc: convert_to(root, src, enc) for enc in ENCODINGS}


@pytest.fixture(scope="module")
def short_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lookup-ctx")
    return convert_to(root, tiny_model_dir(root, max_position_embeddings=48), "int8")


@pytest.fixture(scope="module")
def small_blocks(tiny) -> rt.Model:
    """The int8 tiny model with 4-token KV blocks: drafts cross block boundaries."""
    with _open(tiny["int8"], kv_block_size=4) as m:
        yield m


def _open(pkg: Path, **kw) -> rt.Model:
    native_runtime_module("decoder_layer")
    kw.setdefault("kernels", "native")
    return rt.open(pkg, verify="none", **kw)


def _prompts(n: int = 6) -> list[list[int]]:
    """Prompts that repeat themselves (so drafts exist) with random tails."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        base = [int(t) for t in rng.integers(1, 288, 6 + i)]
        out.append(base * 3 + base[: 2 + i % 3])
    return out


def _run(model: rt.Model, prompt: list[int], lookup, **kw) -> tuple[list[int], rt.Session]:
    s = model.session()
    return list(s.generate(prompt, **{"max_tokens": 40, **kw}, lookup=lookup)), s


def _oracle(monkeypatch: pytest.MonkeyPatch, full: list[int], wrong_every: int = 0) -> None:
    """Drafts that are the true continuation ``full`` (a tiny random model rarely
    repeats itself), the last of a draft made wrong at every ``wrong_every``-th length:
    long runs of accepted drafts, so stops and limits land inside them."""

    def match(self: DraftIndex, k: int) -> tuple[list[int], int]:
        n = len(self.tokens)
        if k <= 0 or self.tokens != full[:n] or n >= len(full):
            return [], 0
        draft = list(full[n : n + k])
        if wrong_every and n % wrong_every == 0:
            draft[-1] = (draft[-1] + 1) % 288
        return draft, 3

    monkeypatch.setattr(DraftIndex, "match", match)


def _plain(m: rt.Model, prompt: list[int], monkeypatch, wrong_every: int | None) -> list[int]:
    """30 plain greedy tokens; then drafts from :func:`_oracle` unless ``wrong_every`` is
    None (the real n-gram drafts)."""
    plain, _ = _run(m, prompt, False, max_tokens=30)
    if wrong_every is not None:
        _oracle(monkeypatch, prompt + plain, wrong_every)
    return plain


@pytest.mark.parametrize("kv", ["int8", "float"])
@pytest.mark.parametrize("enc", ENCODINGS)
def test_native_kernels_are_batch_invariant(tiny, enc: str, kv: str) -> None:
    """Each row of a many-token pass equals a one-token pass bit for bit (logits and the
    K/V written): what lets a verify pass stand in for decode steps."""
    with _open(tiny[enc], kv=kv) as m:
        assert batch_invariant(m), m.kernel_path
        ids = [int(t) for t in np.random.default_rng(0).integers(0, 288, 30)]
        one, many = m.new_sequence(), m.new_sequence()
        m.forward(one, ids[:20])
        m.forward(many, ids[:20])
        singles = np.stack([m.forward(one, [t]) for t in ids[20:]])
        batched = m.forward(many, ids[20:], logits="all")
        np.testing.assert_array_equal(singles, batched)
        after = [m.forward(s, [5]) for s in (one, many)]
        np.testing.assert_array_equal(after[0], after[1])


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("lookup", [True, "auto"])
def test_greedy_output_is_identical(tiny, enc: str, lookup) -> None:
    drafted = accepted = 0
    with _open(tiny[enc], kv_block_size=4) as m:
        for prompt in _prompts():
            plain, ps = _run(m, prompt, False)
            got, ls = _run(m, prompt, lookup)
            assert got == plain
            assert ls.tokens == ps.tokens  # the K/V held: all but the last token
            assert ls.stats.finish_reason == ps.stats.finish_reason
            assert ls.stats.generated_tokens == ps.stats.generated_tokens
            assert ps.stats.drafted_tokens == 0 and ps.stats.lookup == "off"
            drafted += ls.stats.drafted_tokens
            accepted += ls.stats.accepted_tokens
    if lookup is True:
        assert 0 < accepted < drafted  # drafts were both kept and rejected


@pytest.mark.parametrize("wrong_every", [0, 5, None])
def test_max_tokens_at_every_draft_boundary(small_blocks, monkeypatch, wrong_every) -> None:
    prompt = _prompts()[2]
    plain = _plain(small_blocks, prompt, monkeypatch, wrong_every)
    for n in range(1, 31):
        got, s = _run(small_blocks, prompt, True, max_tokens=n)
        assert got == plain[:n], n
        assert s.tokens == prompt + plain[: n - 1]
    if wrong_every == 0:
        # 29 tokens after the prefill's: three passes of 8 drafts + 1, then 1 + 1
        assert s.stats.accepted_tokens == s.stats.drafted_tokens == 25
        assert s.stats.verify_passes == 4


@pytest.mark.parametrize("wrong_every", [0, 4, None])
def test_stop_tokens_inside_a_draft(small_blocks, monkeypatch, wrong_every) -> None:
    prompt = _prompts()[4]
    plain = _plain(small_blocks, prompt, monkeypatch, wrong_every)
    for j in range(1, 30):
        stop = [plain[j]]
        want, ps = _run(small_blocks, prompt, False, max_tokens=30, stop=stop)
        got, ls = _run(small_blocks, prompt, True, max_tokens=30, stop=stop)
        assert got == want and ls.stats.finish_reason == ps.stats.finish_reason == "eos"
        assert ls.tokens == ps.tokens


def test_drafts_end_at_stop_tokens(small_blocks, monkeypatch) -> None:
    """Nothing after a stop token is generated: the session's drafts end at one (and at
    the model's own stop tokens), as at a line break (the index's cut: a unit test); a
    draft of the model's own output ends at the stop tokens only."""
    ends: list[frozenset[int]] = []
    stops: list[frozenset[int] | None] = []
    init = LookupDecoder.__init__

    def recorded(self: LookupDecoder, *args, **kw) -> None:
        init(self, *args, **kw)
        ends.append(self.index.ends)
        stops.append(self.index.stops)

    monkeypatch.setattr(LookupDecoder, "__init__", recorded)
    prompt = _prompts()[0]
    want, _ = _run(small_blocks, prompt, False, max_tokens=30, stop=[prompt[3]])
    got, _ = _run(small_blocks, prompt, True, max_tokens=30, stop=[prompt[3]])
    assert got == want
    assert ends == [draft_ends(small_blocks) | {prompt[3]} | small_blocks.stop_token_ids()]
    assert stops == [{prompt[3]} | small_blocks.stop_token_ids()]


def test_a_closed_stream_leaves_the_plain_context(tiny, monkeypatch) -> None:
    with _open(tiny["int8"], kv_block_size=4) as m:
        prompt = _prompts()[4]
        plain = _plain(m, prompt, monkeypatch, 0)
        s = m.session()
        stream = s.generate(prompt, 30, lookup=True)
        got = [next(stream) for _ in range(3)]  # inside the first 8-token draft
        stream.close()
        assert got == plain[:3]
        assert s.tokens == prompt + plain[:2]


@pytest.mark.parametrize("wrong_every", [0, 3, None])
def test_context_limit(short_context: Path, monkeypatch, wrong_every) -> None:
    with _open(short_context, kv_block_size=4) as m:
        for prompt in _prompts(4):
            plain, ps = _run(m, prompt, False)
            if wrong_every is not None:
                _oracle(monkeypatch, prompt + plain, wrong_every)
            got, ls = _run(m, prompt, True)
            assert ps.stats.finish_reason == "context"
            assert got == plain and ls.stats.finish_reason == "context"
            assert ls.tokens == ps.tokens
            monkeypatch.undo()


def test_next_turn_continues_identically(tiny) -> None:
    """The K/V a lookup run leaves behind serve the next call like plain decoding's."""
    prompt = _prompts()[1]
    outs = []
    for lookup in (False, True):
        with _open(tiny["int4-g32"], kv_block_size=4) as m:  # a prefix cache of its own
            s = m.session()
            first = list(s.generate(prompt, 25, lookup=lookup))
            second = list(s.generate(prompt + first + prompt[:9], 25, lookup=lookup))
            outs.append((first, second, s.stats.cached_prompt_tokens, s.tokens))
    assert outs[0] == outs[1]


def test_shared_blocks_are_not_changed(tiny) -> None:
    """Drafts written past a fork point or into prefix-cached blocks and then cut back
    must not change what another sequence sharing those blocks reads."""
    with _open(tiny["int8"], kv_block_size=4) as m:
        prompt = _prompts()[3]
        plain, _ = _run(m, prompt, False)
        base = m.session()
        list(base.generate(prompt, 1))
        fork = base.fork()
        assert list(fork.generate(prompt, 40, lookup=True)) == plain
        assert list(base.generate(prompt, 40)) == plain  # its blocks were left alone
        again, _ = _run(m, prompt, False)  # now from the prefix cache
        assert again == plain
        assert m.kv_pool.stats.cow_copies > 0


def test_sampling_runs_plain(tiny) -> None:
    with _open(tiny["int8"]) as m:
        prompt = _prompts()[0]
        kw = {"temperature": 0.8, "seed": 3}
        plain, _ = _run(m, prompt, False, **kw)
        got, s = _run(m, prompt, True, **kw)
        assert got == plain
        assert s.stats.lookup == "off" and s.stats.drafted_tokens == 0


def test_repetition_penalty_is_applied_per_position(tiny) -> None:
    with _open(tiny["f32"]) as m:
        for prompt in _prompts(3):
            plain, _ = _run(m, prompt, False, repetition_penalty=1.3)
            got, _ = _run(m, prompt, True, repetition_penalty=1.3)
            assert got == plain


def test_auto_stays_off_on_kernels_that_are_not_batch_invariant(tiny) -> None:
    with rt.open(tiny["int8"], verify="none", kernels="numpy") as m:
        assert not batch_invariant(m)
        _, s = _run(m, _prompts()[0], "auto")
        assert s.stats.lookup == "off" and s.stats.drafted_tokens == 0


def test_auto_stays_off_where_native_attention_runs_on_numpy(tmp_path: Path) -> None:
    """head_dim 12 with the legacy int8 cache (V group 12, not a multiple of 8): the
    native backend attends on numpy, whose rows of a many-token pass differ from
    one-token passes; the probe finds it out."""
    src = tiny_model_dir(tmp_path, hidden_size=96, num_attention_heads=8, num_key_value_heads=4)
    with _open(convert_to(tmp_path, src, "int8"), kv="int8-legacy") as m:
        assert m.config.head_dim == 12
        assert not batch_invariant(m)
        _, s = _run(m, _prompts()[0], "auto")
        assert s.stats.lookup == "off"


def test_pass_costs_are_measured_once_per_model(tiny) -> None:
    with _open(tiny["int8"]) as m:
        costs = pass_costs(m)
        assert not costs.measured_sizes
        _run(m, _prompts()[0], True)
        assert 1 in costs.measured_sizes and any(n > 1 for n in costs.measured_sizes)
        assert pass_costs(m) is costs  # the next session starts from them
        with _open(tiny["int8"]) as other:
            assert pass_costs(other) is not costs


def test_acceptance_is_measured_once_per_model(tiny) -> None:
    with _open(tiny["int8"]) as m:
        counts = acceptance_counts(m)
        assert not counts
        _, s = _run(m, _prompts()[0], True)
        assert s.stats.drafted_tokens > 0
        trials = sum(t for _, t in counts.values())
        assert trials > 0  # the prior plus what the call compared
        _run(m, _prompts()[1], True)
        assert acceptance_counts(m) is counts  # the next call starts from them
        assert sum(t for _, t in counts.values()) != trials
        with _open(tiny["int8"]) as other:
            assert acceptance_counts(other) is not counts


def test_a_full_kv_cache_on_a_draft_pass_falls_back_to_plain(tiny, monkeypatch) -> None:
    """A verify pass can need a block plain decoding would not (a copy-on-write copy):
    when the pool has none, lookup stops for the call and decoding goes on plainly."""
    from edgepack.runtime_shim.errors import KVCacheFullError

    with _open(tiny["int8"]) as m:
        prompt = _prompts()[2]
        plain, _ = _run(m, prompt, False)
        forward = m.forward

        def tight(seq, tokens, **kw):
            if len(tokens) > 1 and seq.length > len(prompt):
                raise KVCacheFullError("KV cache full")
            return forward(seq, tokens, **kw)

        monkeypatch.setattr(m, "forward", tight)
        _oracle(monkeypatch, prompt + plain)
        got, s = _run(m, prompt, True)
        assert got == plain and s.tokens == prompt + plain[:-1]
        assert s.stats.lookup == "off" and s.stats.verify_passes == 1  # the one that fit


def test_bad_lookup_value_is_refused(tiny) -> None:
    with rt.open(tiny["int8"], verify="none") as m:
        with pytest.raises(ValueError, match="lookup"):
            m.generate([1, 2, 3], lookup="sometimes")
