"""Prompt lookup's parts without a model: the n-gram draft index, the cost model and the
policy that turns drafting off when it would be slower (a fake cost model drives it)."""

from __future__ import annotations

import pytest

from edgepack.runtime_shim.lookup import (
    DraftIndex,
    LookupDecoder,
    LookupPolicy,
    PassCosts,
    acceptance_key,
    draft_ends,
    lookup_mode,
    reflowed,
)


# -- drafts ------------------------------------------------------------------------------
def test_draft_follows_the_longest_recent_suffix_match() -> None:
    # suffix (1, 2, 3) occurred at the start, followed by 4, 5, 6
    idx = DraftIndex([1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 1, 2, 3])
    assert idx.draft(3) == [4, 5, 6]
    assert idx.draft(10) == [4, 5, 6, 9, 2, 3, 7, 1, 2, 3]


def test_a_longer_match_wins_over_a_more_recent_shorter_one() -> None:
    # (8, 3) occurred once early (then 4); 3 alone occurred later (then 7)
    idx = DraftIndex([8, 3, 4, 0, 3, 7, 8, 3])
    assert idx.draft(1) == [4]


def test_the_most_recent_occurrence_of_the_same_length_wins() -> None:
    idx = DraftIndex([5, 1, 5, 2, 5])
    assert idx.draft(1) == [2]


def test_no_earlier_occurrence_gives_no_draft() -> None:
    assert DraftIndex([1, 2, 3]).draft(4) == []
    assert DraftIndex([]).draft(4) == []
    assert DraftIndex([1, 1]).draft(0) == []


def test_push_extends_the_index_like_building_it_at_once() -> None:
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3]
    grown = DraftIndex()
    for i, t in enumerate(seq):
        grown.push(t)
        assert grown.draft(4) == DraftIndex(seq[: i + 1]).draft(4)


def test_of_several_occurrences_the_one_agreeing_furthest_back_wins() -> None:
    # (2, 3) occurred after 1 (then 4) and later after 9 (then 5); the context ends 1 2 3
    idx = DraftIndex([1, 2, 3, 4, 0, 9, 2, 3, 5, 0, 1, 2, 3])
    assert idx.draft(1) == [4]
    # agreement is looked for only ``reach`` tokens back: then the most recent wins
    assert DraftIndex([1, 2, 3, 4, 0, 9, 2, 3, 5, 0, 1, 2, 3], max_n=2, reach=2).draft(1) == [5]
    # the suffix 8 2 3 never occurred: equal agreement, the most recent wins
    assert DraftIndex([1, 2, 3, 4, 0, 9, 2, 3, 5, 0, 8, 2, 3]).draft(1) == [5]


def test_only_the_most_recent_candidates_are_compared() -> None:
    seq = [1, 2, 3, 4, *([0, 2, 3, 5] * 3), 1, 2, 3]
    assert DraftIndex(seq, max_n=2).draft(1) == [4]
    assert DraftIndex(seq, max_n=2, candidates=3).draft(1) == [5]


def test_a_draft_ends_after_a_line_break_token() -> None:
    idx = DraftIndex([1, 2, 3, 10, 4, 5, 1, 2], ends=frozenset({10}))
    assert idx.draft(5) == [3, 10]
    assert idx.match(1) == ([3], 2)
    assert DraftIndex([1, 2, 3, 10, 4, 5, 1, 2]).draft(5) == [3, 10, 4, 5, 1]


def test_a_draft_of_the_models_own_output_runs_past_a_line_break() -> None:
    """Given ``stops``, a draft copied from the tokens pushed later (the model's output)
    ends at a stop only; one copied from the tokens the index was built with still ends
    at a line break; without ``stops`` every draft ends at every one of ``ends``."""
    ends, stops = frozenset({10, 99}), frozenset({99})
    built = [1, 2, 3, 10, 4, 5]
    idx = DraftIndex(built, ends=ends, stops=stops)
    assert idx.draft(5) == []
    for t in (1, 2):
        idx.push(t)
    assert idx.draft(5) == [3, 10]  # the input's occurrence: ends at its line break
    for t in (7, 8, 10, 6, 99, 0, 7, 8):
        idx.push(t)
    assert idx.draft(5) == [10, 6, 99]  # the output's: past the break, ends at the stop
    assert DraftIndex([*built, 1, 2, 7, 8, 10, 6, 99, 0, 7, 8], ends=ends).draft(5) == [10]
    plain = DraftIndex(built, ends=ends)
    for t in (7, 8, 10, 6, 99, 0, 7, 8):
        plain.push(t)
    assert plain.draft(5) == [10]


def test_occurrences_that_disagree_on_what_follows_make_a_match_ambiguous() -> None:
    idx = DraftIndex([1, 2, 3, 9, 2, 3, 9, 2, 3])
    assert not idx.ambiguous(2)  # (2, 3) was followed by 9 both times
    idx = DraftIndex([1, 2, 3, 9, 2, 3, 8, 2, 3])
    assert idx.ambiguous(2) and idx.ambiguous(1)  # 9, then 8
    assert not idx.ambiguous(3)  # (8, 2, 3) never occurred before
    assert not idx.ambiguous(0)
    # only the ``candidates`` most recent occurrences are compared
    assert not DraftIndex([2, 3, 8, 2, 3, 9, 2, 3, 9, 2, 3], max_n=2, candidates=2).ambiguous(2)


def test_ngram_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        DraftIndex(max_n=1, min_n=2)
    assert DraftIndex([1, 2, 9, 1, 2], max_n=3, min_n=2).draft(1) == [9]
    assert DraftIndex([1, 9, 2, 1], max_n=3, min_n=2).draft(1) == []


def test_lookup_mode_accepts_only_the_three_modes() -> None:
    assert lookup_mode(True) is True and lookup_mode(False) is False
    assert lookup_mode("auto") == "auto"
    for bad in ("on", 1, None):
        with pytest.raises(ValueError):
            lookup_mode(bad)


class _CharTokenizer:
    """One token per character (its code point)."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def ids_containing(self, text: str) -> frozenset[int]:  # of the first 128 code points
        return frozenset(i for i in range(128) if text in self.decode([i]))


def test_reflowed_makes_line_breaks_and_double_spaces_between_words_one_space() -> None:
    tok = _CharTokenizer()
    text = "A name is\nbound  here.  Then\n  used.\n\nNext paragraph\n"
    want = "A name is bound here. Then used.\n\nNext paragraph\n"
    assert reflowed(tok, tok.encode(text)) == tok.encode(want)
    assert reflowed(tok, tok.encode(want)) == []  # nothing to re-flow


def test_draft_ends_are_the_tokens_holding_a_line_break() -> None:
    class _Config:
        vocab_size = 128

    class _Model:
        config = _Config()
        tokenizer = _CharTokenizer()

    model = _Model()
    assert draft_ends(model) == frozenset({10})
    assert draft_ends(model) is draft_ends(model)  # found once per model


def test_a_source_drafts_what_the_context_has_after_a_line_break() -> None:
    # the context wrapped "1 2 | 3 4 5" as 1 2 <newline> 13 4 5 (13: "3" starting a line);
    # the text so far went on "1 2 3" as the re-flowed source has it
    context = [7, 1, 2, 10, 13, 4, 5, 9, 1, 2, 3]
    flowed = [7, 1, 2, 3, 4, 5, 9]
    assert LookupDecoder(LookupPolicy(always=True), context).propose(3) == []
    dec = LookupDecoder(LookupPolicy(always=True), context, sources=[flowed])
    assert dec.propose(3) == [4, 5, 9]
    # of two equally long matches the context's (more recent) wins
    dec = LookupDecoder(LookupPolicy(always=True), [1, 2, 8, 1, 2], sources=[[1, 2, 6]])
    assert dec.propose(1) == [8]


# -- costs -------------------------------------------------------------------------------
def test_unmeasured_sizes_are_estimated_from_the_measured_slope() -> None:
    costs = PassCosts(smoothing=1.0, prior_slope=0.5)
    assert costs.estimate(4) is None
    costs.observe(1, 10.0)
    assert costs.estimate(3) == pytest.approx(20.0)  # prior: half a step per token
    costs.observe(5, 14.0)  # measured: one step per token
    assert costs.estimate(5) == 14.0
    assert costs.estimate(3) == pytest.approx(12.0)


def test_costs_are_a_moving_average() -> None:
    costs = PassCosts(smoothing=0.5)
    costs.observe(1, 10.0)
    costs.observe(1, 20.0)
    assert costs.estimate(1) == pytest.approx(15.0)


def test_a_pass_is_never_estimated_dearer_than_a_longer_one_was_measured() -> None:
    """One pass of 4 timed in a busy moment: a pass of 5 measured cheaper caps it, so the
    policy picks 4 again (and so times it again) instead of avoiding it for good."""
    costs = PassCosts(smoothing=1.0)
    costs.observe(1, 10.0)
    costs.observe(4, 40.0)
    costs.observe(5, 13.0)
    assert costs.estimate(4) == 13.0
    assert costs.estimate(3) == pytest.approx(min(13.0, 10.0 + 2 * (30.0 / 3 + 3.0 / 4) / 2))
    assert costs.estimate(5) == 13.0
    assert costs.estimate(6) == pytest.approx(10.0 + 5 * (30.0 / 3 + 3.0 / 4) / 2)
    policy = LookupPolicy(prior_accepted=90.0, prior_trials=100.0, costs=costs, max_draft=4)
    assert policy.draft_length() == 4  # a pass of 5 at 1.3 steps: worth it
    assert LookupPolicy(
        prior_accepted=90.0, prior_trials=100.0, costs=costs, max_draft=3
    ).draft_length() == 3  # a pass of 4 is estimated at 13, not the 40 timed once


# -- policy ------------------------------------------------------------------------------
def _policy(step: float, per_token: float, accepted: float, trials: float = 100.0, **kw):
    """A policy whose pass of m tokens costs ``step + per_token * (m - 1)``, with an
    acceptance history of ``accepted`` out of ``trials``."""
    costs = PassCosts(smoothing=1.0)
    for m in range(1, 10):
        costs.observe(m, step + per_token * (m - 1))
    return LookupPolicy(prior_accepted=accepted, prior_trials=trials, costs=costs, **kw)


def test_cheap_verify_and_high_acceptance_drafts_the_most() -> None:
    assert _policy(10.0, 0.5, 90.0).draft_length() == 8


def test_low_acceptance_turns_drafting_off() -> None:
    assert _policy(10.0, 0.5, 2.0).draft_length() == 0


def test_expensive_verify_turns_drafting_off_even_at_good_acceptance() -> None:
    # a pass of k+1 costs as much as k+1 steps: drafting can never win
    assert _policy(10.0, 10.0, 80.0).draft_length() == 0


def test_moderate_cost_picks_a_middle_length() -> None:
    k = _policy(10.0, 3.0, 60.0).draft_length()
    assert 0 < k < 8
    # E(k)/cost(k+1) at the chosen k beats every other k
    a = 0.6

    def rate(k: int) -> float:
        return sum(a**i for i in range(k + 1)) / (10.0 + 3.0 * k)

    assert all(rate(k) >= rate(j) for j in range(1, 9))


def test_the_cap_limits_the_draft() -> None:
    assert _policy(10.0, 0.5, 90.0).draft_length(available=3) == 3
    assert _policy(10.0, 0.5, 90.0).draft_length(available=0) == 0


def test_no_decode_step_timed_yet_means_no_draft() -> None:
    assert LookupPolicy().draft_length() == 0
    assert LookupPolicy(always=True).draft_length() == 8


def test_always_drafts_whatever_it_costs() -> None:
    assert _policy(10.0, 10.0, 0.0, always=True).draft_length() == 8


def test_acceptance_counts_compared_drafts_up_to_the_first_rejection() -> None:
    p = LookupPolicy(prior_accepted=0.0, prior_trials=0.0, decay=1.0)
    p.record_acceptance(drafted=5, accepted=2)  # 2 right, the third wrong, 2 never compared
    assert p.acceptance() == pytest.approx(2 / 3)
    p.record_acceptance(drafted=3, accepted=3)
    assert p.acceptance() == pytest.approx(5 / 6)
    p.record_acceptance(drafted=0, accepted=0)
    assert p.acceptance() == pytest.approx(5 / 6)


def test_acceptance_is_kept_per_match_length_and_pooled_for_new_lengths() -> None:
    p = LookupPolicy(prior_accepted=0.0, prior_trials=0.0, decay=1.0)
    p.record_acceptance(drafted=4, accepted=4, matched=3)
    p.record_acceptance(drafted=4, accepted=0, matched=1)
    assert p.acceptance(3) == 1.0
    assert p.acceptance(1) == 0.0
    assert p.acceptance(2) == pytest.approx(4 / 5)  # not seen: all matches pooled


def test_acceptance_key_sets_ambiguous_matches_apart() -> None:
    assert acceptance_key(3, False) == 3
    assert acceptance_key(3, True) not in (0, 1, 2, 3)
    assert acceptance_key(2, True) != acceptance_key(3, True)


def test_the_decoder_keeps_acceptance_of_ambiguous_matches_apart() -> None:
    """The same 2-token match drafts while its occurrences agree on what follows and
    stops drafting once they disagree and such drafts were measured wrong."""
    costs = PassCosts(smoothing=1.0)
    for m in range(1, 10):
        costs.observe(m, 10.0 + m)
    counts = {
        acceptance_key(2, False): (9.0, 10.0),
        acceptance_key(2, True): (0.0, 10.0),
    }
    policy = LookupPolicy(max_draft=2, costs=costs, counts=counts)
    assert LookupDecoder(policy, [5, 1, 2, 7, 7, 6, 1, 2]).propose(2) == [7, 7]
    dec = LookupDecoder(policy, [5, 1, 2, 7, 7, 4, 1, 2, 8, 6, 1, 2])
    assert dec.propose(2) == []
    for t in (8, 6):  # the shadow draft (8, 6) was right: measured under its own key
        dec.push(t)
    assert counts[acceptance_key(2, True)][0] > 0.0
    assert counts[acceptance_key(2, False)] == (9.0, 10.0)


def test_a_good_match_length_drafts_while_a_poor_one_does_not() -> None:
    p = _policy(10.0, 2.0, 0.0, trials=0.0, decay=1.0)
    for _ in range(10):
        p.record_acceptance(4, 4, matched=3)
        p.record_acceptance(4, 0, matched=1)
    assert p.draft_length(matched=3) > 0
    assert p.draft_length(matched=1) == 0


def test_falling_acceptance_switches_off_and_rising_switches_back_on() -> None:
    p = _policy(10.0, 1.0, 8.0, trials=10.0)
    assert p.draft_length() > 0
    for _ in range(40):
        p.record_acceptance(4, 0)
    assert p.draft_length() == 0
    for _ in range(60):
        p.record_acceptance(4, 4)
    assert p.draft_length() > 0


def test_policies_given_one_table_share_what_they_measured() -> None:
    shared: dict[int, tuple[float, float]] = {}
    first = LookupPolicy(prior_accepted=0.0, prior_trials=0.0, decay=1.0, counts=shared)
    first.record_acceptance(drafted=4, accepted=4, matched=3)
    later = LookupPolicy(prior_accepted=0.0, prior_trials=0.0, decay=1.0, counts=shared)
    assert later.acceptance(3) == 1.0
    assert LookupPolicy(prior_accepted=0.0, prior_trials=1.0).acceptance(3) == 0.0  # own table


# -- decoder -----------------------------------------------------------------------------
def test_shadow_drafts_measure_acceptance_while_off() -> None:
    """With drafting off the draft is still looked up and compared with the tokens that
    come: acceptance keeps being measured at no model cost, so lookup can switch on."""
    costs = PassCosts(smoothing=1.0)
    costs.observe(1, 10.0)
    costs.observe(5, 11.0)
    policy = LookupPolicy(
        max_draft=4, decay=1.0, prior_accepted=0.0, prior_trials=10.0, costs=costs
    )
    dec = LookupDecoder(policy, [1, 2, 3, 4, 5, 6, 1, 2])
    assert dec.propose(4) == []  # off: acceptance 0
    for t in (3, 4, 5, 6):  # the text goes on exactly as the looked-up draft said
        dec.push(t)
    assert policy.acceptance(2) == pytest.approx(4 / 14)  # after a 2-token match
    draft = dec.propose(4)  # worth it now
    assert draft and draft == [1, 2, 3, 4][: len(draft)]
    assert dec.stats.drafted == 0  # nothing was sent to a model yet


def test_a_wrong_shadow_draft_counts_as_one_rejection() -> None:
    costs = PassCosts(smoothing=1.0)
    costs.observe(1, 10.0)
    costs.observe(2, 100.0)  # verifying is hopeless: stays off
    policy = LookupPolicy(max_draft=2, decay=1.0, prior_accepted=0.0, prior_trials=0.0, costs=costs)
    dec = LookupDecoder(policy, [7, 8, 9, 7])
    assert dec.propose(2) == []
    dec.push(8)
    dec.push(0)  # the draft said 8, 9
    assert policy.acceptance(1) == pytest.approx(1 / 2)


def test_verified_passes_are_counted() -> None:
    dec = LookupDecoder(LookupPolicy(always=True), [1, 2, 1])
    assert dec.propose(3) == [2, 1]
    dec.verified(2, 1)
    assert (dec.stats.drafted, dec.stats.accepted, dec.stats.passes) == (2, 1, 1)


def test_the_exactness_check_is_asked_once_when_a_draft_is_first_wanted() -> None:
    asked = []

    def exact() -> bool:
        asked.append(1)
        return False

    dec = LookupDecoder(LookupPolicy(always=True), [1, 2, 1], exact)
    assert dec.propose(0) == [] and not asked  # no draft wanted: not asked
    assert dec.propose(3) == [] and dec.off and len(asked) == 1
    dec.push(2)
    assert dec.propose(3) == [] and len(asked) == 1


def test_a_passing_exactness_check_lets_drafts_through() -> None:
    dec = LookupDecoder(LookupPolicy(always=True), [1, 2, 1], lambda: True)
    assert dec.propose(3) == [2, 1] and not dec.off
