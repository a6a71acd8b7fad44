"""Prompt-lookup decoding: draft tokens copied from the context, verified in one pass.

Text that rewrites, summarises or quotes its input repeats n-grams of it. After each
generated token the longest recent suffix of the context (prompt + text so far, n = 3
down to 1) is looked up among earlier positions; the tokens that followed its earlier
occurrence agreeing furthest back with the context (so a copy in progress goes on from
where it copies; of equals the most recent) are the draft, up to the next line break
(past it where the draft copies the model's own output: a model repeating itself repeats
its line breaks too).
The session feeds ``[last token, *draft]`` to one forward pass, keeps the drafts greedy
decoding would have chosen itself (plus the token after them, which that pass also
predicts) and cuts the KV sequence back past the first rejected one. The output is token
for token what plain greedy decoding gives when the kernels are batch invariant (each
row of a many-token pass bit-identical to a one-token pass: the native kernels'
whole-layer path is, and a test holds it to that); numpy's BLAS is not (rows differ by
~1e-6, enough to flip a near tie), nor is the native backend where it runs attention on
numpy (a KV layout it lacks), so ``"auto"`` drafts only where :func:`batch_invariant`
found the model's own passes so, by trying them once.
Sampling runs plain (this is no speculative-sampling implementation).

Drafts are also looked up in the prompt re-flowed (:func:`reflowed`): a rewrite copies
the words of hard-wrapped text, not its line breaks or double spaces, and a copy that
continues past a source line break is then still found.

Whether to draft, and how many tokens, is :class:`LookupPolicy`'s call: it compares the
expected tokens per verify pass (from the measured acceptance rate) against the
measured cost of a pass of that size relative to one decode step, and drafts nothing
when no draft length would be faster. Acceptance by match length, like the pass costs,
is a property of the model and the kind of text: both are kept per model (acceptance
also apart for matches whose earlier occurrences disagree on what follows, where the
draft is one guess of several: :func:`acceptance_key`), so a call
starts from what earlier calls measured. Acceptance keeps being measured while it is off
(the draft is still looked up and compared with what plain decoding produced, at no
model cost), so it switches itself back on when the text starts copying again.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .errors import KVCacheFullError, TokenizerUnavailableError

if TYPE_CHECKING:
    from .model import Model
    from .tokenizer import Tokenizer

__all__ = [
    "LOOKUP_MODES",
    "DraftIndex",
    "LookupDecoder",
    "LookupPolicy",
    "PassCosts",
    "acceptance_counts",
    "acceptance_key",
    "batch_invariant",
    "draft_ends",
    "draft_sources",
    "lookup_mode",
    "pass_costs",
    "reflowed",
]

LOOKUP_MODES = (True, False, "auto")


def lookup_mode(value: object) -> bool | str:
    """``True`` (always draft), ``False`` (never) or ``"auto"`` (the policy decides)."""
    if value is True or value is False or value == "auto":
        return value  # type: ignore[return-value]
    raise ValueError(f"lookup must be True, False or 'auto', got {value!r}")


_INVARIANT: weakref.WeakKeyDictionary[Model, bool] = weakref.WeakKeyDictionary()
_COSTS: weakref.WeakKeyDictionary[Model, PassCosts] = weakref.WeakKeyDictionary()
_ACCEPTANCE: weakref.WeakKeyDictionary[Model, dict[int, tuple[float, float]]] = (
    weakref.WeakKeyDictionary()
)
_ENDS: weakref.WeakKeyDictionary[Model, frozenset[int]] = weakref.WeakKeyDictionary()
_PROBE = (4, 4)  # tokens prefilled, then decoded one by one vs in one pass


def batch_invariant(model: Model, try_passes: bool = True) -> bool:
    """Whether ``model``'s passes give each row of a many-token pass bit for bit what a
    one-token pass gives (logits and the K/V written). Native kernels with no op on
    numpy only, then tried once per model on two scratch sequences of 9 tokens (under
    100 ms on SmolLM2-135M; released after, a full block of them at most stays as an
    evictable cached prefix). ``try_passes=False``: the answer without running the
    model (True when only trying could tell)."""
    known = _INVARIANT.get(model)
    if known is not None:
        return known
    path = model.kernel_path
    if not path.startswith("native") or "numpy" in path:
        _INVARIANT[model] = False
        return False
    if not try_passes:
        return True
    head, tail = _PROBE
    vocab = model.config.vocab_size
    ids = [(7919 * i + 1) % vocab for i in range(head + tail + 1)]
    one, many = model.new_sequence(), model.new_sequence()
    try:
        model.forward(one, ids[:head], logits="none")
        model.forward(many, ids[:head], logits="none")
        batched = model.forward(many, ids[head:-1], logits="all")
        same = True  # each one-token pass compared as it comes (not all kept: 192 KiB each)
        for t, row in zip(ids[head:-1], batched, strict=True):
            same &= np.array_equal(model.forward(one, [t]), row)
        same &= np.array_equal(*(model.forward(seq, ids[-1:]) for seq in (one, many)))
    except KVCacheFullError:
        return False  # no room to try now: plain decoding, try again next time
    finally:
        with model.lock:
            one.release()
            many.release()
    _INVARIANT[model] = same
    return same


class DraftIndex:
    """Where each n-gram (n = ``min_n``..``max_n``) of the context occurred, so the
    continuation of the current suffix is found in O(max_n + reach) per token.

    Of several earlier occurrences of the longest matching suffix the draft follows the
    one whose preceding tokens match the context furthest back (up to ``reach`` tokens,
    among the ``candidates`` most recent; of equals the most recent): a rewrite that
    copies a phrase occurring twice in its source continues where it is copying from,
    not from the phrase's last occurrence. A draft ends after the first token of
    ``ends`` (line breaks: where the copy it follows usually stops). ``stops`` (a part of
    ``ends``: the stop tokens), when given, are the only ends of a draft copied from the
    tokens pushed after the index was built (the model's output): a model repeating
    itself repeats its line breaks too."""

    def __init__(
        self,
        tokens: Iterable[int] = (),
        max_n: int = 3,
        min_n: int = 1,
        reach: int = 16,
        candidates: int = 16,
        ends: frozenset[int] = frozenset(),
        stops: frozenset[int] | None = None,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n
        self.reach, self.candidates, self.ends = reach, candidates, ends
        self.stops = stops
        self.tokens: list[int] = []
        # n-gram -> indices of the tokens that followed its occurrences, oldest first
        self._next: dict[tuple[int, ...], list[int]] = {}
        for t in tokens:
            self.push(t)
        self.output_from = len(self.tokens)  # where the tokens pushed later begin

    def push(self, token: int) -> None:
        toks = self.tokens
        end = len(toks)  # the n-grams ending just before the new token now have a follower
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self._next.setdefault(tuple(toks[end - n : end]), []).append(end)
        toks.append(int(token))

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the best earlier occurrence of the longest
        matching suffix; empty when no suffix occurred before."""
        return self.match(k)[0]

    def match(self, k: int) -> tuple[list[int], int]:
        """:meth:`draft` and the length of the suffix it matched (0: none)."""
        toks = self.tokens
        if k <= 0:
            return [], 0
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            starts = self._next.get(tuple(toks[len(toks) - n :]))
            if starts:
                start = self._best(starts, n)
                draft = toks[start : start + k]
                own = self.stops is not None and start >= self.output_from
                ends = self.stops if own else self.ends
                for i, t in enumerate(draft):
                    if t in ends:
                        return draft[: i + 1], n
                return draft, n
        return [], 0

    def ambiguous(self, n: int) -> bool:
        """Whether the earlier occurrences of the last ``n`` tokens (the ``candidates``
        most recent) disagree on the token that followed them."""
        toks = self.tokens
        starts = self._next.get(tuple(toks[len(toks) - n :]), []) if n > 0 else []
        return len({toks[i] for i in starts[-self.candidates :]}) > 1

    def _best(self, starts: list[int], n: int) -> int:
        """Of ``starts`` (each after an occurrence of the ``n``-token suffix), the one
        whose occurrence extends furthest back in agreement with the context."""
        toks, end = self.tokens, len(self.tokens)
        best, best_len = starts[-1], n
        if len(starts) == 1 or self.reach <= n:
            return best
        for start in reversed(starts[-self.candidates :]):
            length = n
            while (
                length < self.reach
                and start - 1 - length >= 0
                and toks[start - 1 - length] == toks[end - 1 - length]
            ):
                length += 1
            if length > best_len:
                best, best_len = start, length
        return best


# a line break between two words, with the spaces around it; two or more spaces between words
_LINE_BREAK = re.compile(r"(?<=\S)[ \t]*\n[ \t]*(?=\S)")
_SPACES = re.compile(r"(?<=\S) {2,}(?=\S)")


def reflowed(tokenizer: Tokenizer, ids: Sequence[int]) -> list[int]:
    """``ids`` as text with every single line break and run of spaces between two words
    made one space, tokenized again (paragraph breaks stay); ``[]`` when that changes
    nothing. A draft source only: the model never sees these tokens."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    flowed = _SPACES.sub(" ", _LINE_BREAK.sub(" ", text))
    return [] if flowed == text else tokenizer.encode(flowed, add_special_tokens=False)


def draft_sources(model: Model, ids: Sequence[int]) -> list[list[int]]:
    """The draft sources besides the context for prompt ``ids``: it :func:`reflowed`
    (none when the package has no tokenizer)."""
    try:
        tokenizer = model.tokenizer
    except TokenizerUnavailableError:
        return []
    flowed = reflowed(tokenizer, ids)
    return [flowed] if flowed else []


def draft_ends(model: Model) -> frozenset[int]:
    """The tokens of ``model``'s vocabulary holding a line break, where drafts end (found
    once per model: :meth:`~.tokenizer.Tokenizer.ids_containing`; none when the package
    has no tokenizer)."""
    ends = _ENDS.get(model)
    if ends is None:
        try:
            tokenizer = model.tokenizer
        except TokenizerUnavailableError:
            return frozenset()
        ends = _ENDS[model] = tokenizer.ids_containing("\n")
    return ends


@dataclass
class PassCosts:
    """Measured seconds of a forward pass by its token count (moving averages).

    Sizes not measured yet are estimated from one decode step plus a per-token slope
    fitted to the sizes that were (``prior_slope`` of a decode step before any was). A
    pass is never estimated dearer than a longer one was measured (more rows are no less
    work): one pass timed in a busy moment does not keep the policy off its size for
    good, it is chosen again, and so timed again, once a longer one measured cheaper."""

    smoothing: float = 0.25
    prior_slope: float = 0.15
    seconds: dict[int, float] = field(default_factory=dict)

    @property
    def measured_sizes(self) -> frozenset[int]:
        """The pass sizes (token counts) timed so far."""
        return frozenset(self.seconds)

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.seconds.get(tokens)
        a = self.smoothing
        self.seconds[tokens] = seconds if old is None else (1 - a) * old + a * seconds

    def estimate(self, tokens: int) -> float | None:
        """Seconds of a pass of ``tokens`` tokens; None before one decode step was timed."""
        own = self.seconds.get(tokens)
        if own is None:
            t1 = self.seconds.get(1)
            if t1 is None:
                return None
            slopes = [(t - t1) / (m - 1) for m, t in self.seconds.items() if m > 1]
            slope = sum(slopes) / len(slopes) if slopes else self.prior_slope * t1
            own = t1 + max(slope, 0.0) * (tokens - 1)
        longer = [t for m, t in self.seconds.items() if m > tokens]
        return min(own, *longer) if longer else own


def pass_costs(model: Model) -> PassCosts:
    """The pass costs measured on ``model`` so far, shared by its sessions and calls."""
    costs = _COSTS.get(model)
    if costs is None:
        costs = _COSTS[model] = PassCosts()
    return costs


def acceptance_key(matched: int, ambiguous: bool) -> int:
    """The key of :class:`LookupPolicy`'s acceptance table for a draft after a
    ``matched``-token suffix match: ``-matched`` when the match's earlier occurrences
    disagree on the token that follows (the draft follows one guess of several)."""
    return -matched if ambiguous else matched


def acceptance_counts(model: Model) -> dict[int, tuple[float, float]]:
    """The draft acceptance measured on ``model`` so far (:class:`LookupPolicy`'s
    ``counts``), shared by its sessions and calls."""
    return _ACCEPTANCE.setdefault(model, {})


@dataclass
class LookupPolicy:
    """How many tokens to draft: the ``k`` in ``0..max_draft`` with the most expected
    tokens per second, ``E(k) / cost(k + 1)`` where ``E(k) = 1 + a + ... + a^k`` for a
    per-token acceptance rate ``a`` (the drafts of a pass stop counting at the first
    rejection). ``k = 0`` is a plain decode step; drafting must beat it by ``margin``.

    ``a`` is a decayed ratio of accepted drafts to drafts compared (each compared draft
    up to and including the first rejected one), starting from ``prior_accepted`` of
    ``prior_trials``, kept per length of the matched suffix (a 3-gram match predicts
    far better than a single token; :func:`acceptance_key`) and over all (for lengths
    not seen yet).
    ``always``: draft ``max_draft`` tokens whatever it costs. ``counts``: the table to
    keep them in (:func:`acceptance_counts` shares one per model; default a new one)."""

    max_draft: int = 8
    always: bool = False
    margin: float = 1.05
    decay: float = 0.95
    prior_accepted: float = 1.0
    prior_trials: float = 2.0
    costs: PassCosts = field(default_factory=PassCosts)
    counts: dict[int, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_draft < 1:
            raise ValueError("max_draft must be >= 1")
        # match length (0: all) -> decayed accepted, trials
        self.counts.setdefault(0, (self.prior_accepted, self.prior_trials))

    def acceptance(self, matched: int = 0) -> float:
        """Estimated chance that a draft token is right, after a ``matched``-token match."""
        accepted, trials = self.counts.get(matched, self.counts[0])
        return accepted / trials if trials > 0 else 0.0

    def record_acceptance(self, drafted: int, accepted: int, matched: int = 0) -> None:
        """A draft of ``drafted`` tokens (after a ``matched``-token suffix match) of which
        the first ``accepted`` were right."""
        if drafted <= 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        fade = self.decay**trials
        prior = (self.prior_accepted, self.prior_trials)
        old = {key: self.counts.get(key, prior) for key in (0, matched)}
        for key, (acc0, trials0) in old.items():
            self.counts[key] = (acc0 * fade + accepted, trials0 * fade + trials)

    def draft_length(self, available: int | None = None, matched: int = 0) -> int:
        """Tokens to draft now (0: a plain decode step), at most ``available``, for a
        draft found after a ``matched``-token suffix match."""
        cap = self.max_draft if available is None else min(self.max_draft, available)
        if cap <= 0:
            return 0
        if self.always:
            return cap
        t1 = self.costs.estimate(1)
        if t1 is None:
            return 0  # time a plain step first
        a = self.acceptance(matched)
        best_k, best_rate = 0, self.margin / t1
        expected = 1.0
        for k in range(1, cap + 1):
            expected += a**k
            cost = self.costs.estimate(k + 1)
            if cost is not None and cost > 0 and expected / cost > best_rate:
                best_k, best_rate = k, expected / cost
        return best_k


@dataclass
class LookupStats:
    drafted: int = 0
    accepted: int = 0
    passes: int = 0


class LookupDecoder:
    """The session's side of lookup decoding: the context index, the policy, and the
    free ("shadow") acceptance measurement while the policy drafts nothing. ``exact``
    is asked the first time a draft is wanted (not before: it may cost model passes);
    False switches lookup off for good (:attr:`off`). ``sources``: more token sequences
    to draft from (the prompt :func:`reflowed`), indexed before the context so that of
    two equally good matches the context's wins; ``ends``: tokens a draft ends after
    (:func:`draft_ends`); ``stops``: those of them a draft of the model's own output
    ends after (:class:`DraftIndex`; None: all)."""

    def __init__(
        self,
        policy: LookupPolicy,
        context: Sequence[int],
        exact: Callable[[], bool] | None = None,
        sources: Iterable[Sequence[int]] = (),
        ends: frozenset[int] = frozenset(),
        stops: frozenset[int] | None = None,
    ) -> None:
        self.policy = policy
        self._exact = exact
        self.off = False
        self.index = DraftIndex(
            [*(t for src in sources for t in src), *context], ends=ends, stops=stops
        )
        self.stats = LookupStats()
        self._shadow: list[int] = []  # a draft not sent to the model, checked as text comes
        self._shadow_hits = 0
        self._shadow_matched = 0
        self.matched = 0  # acceptance key (:func:`acceptance_key`) of the last draft

    def push(self, token: int) -> None:
        """A token joined the context (generated or accepted)."""
        if self._shadow:
            if token == self._shadow[self._shadow_hits]:
                self._shadow_hits += 1
                if self._shadow_hits == len(self._shadow):
                    self._settle_shadow()
            else:
                self._settle_shadow()
        self.index.push(token)

    def _settle_shadow(self) -> None:
        self.policy.record_acceptance(len(self._shadow), self._shadow_hits, self._shadow_matched)
        self._shadow, self._shadow_hits = [], 0

    def propose(self, limit: int) -> list[int]:
        """Draft tokens for the next pass (at most ``limit``; empty: a plain step)."""
        if limit <= 0 or self.off:
            return []
        draft, n = self.index.match(min(self.policy.max_draft, limit))
        matched = acceptance_key(n, self.index.ambiguous(n))
        k = self.policy.draft_length(len(draft), matched)
        if k == 0:
            if draft and not self._shadow:
                self._shadow, self._shadow_matched = draft, matched
            return []
        if self._exact is not None:
            self.off, self._exact = not self._exact(), None
            if self.off:
                return []
        self._shadow, self._shadow_hits = [], 0  # measured for real from here
        self.matched = matched
        return draft[:k]

    def timed(self, tokens: int, seconds: float) -> None:
        self.policy.costs.observe(tokens, seconds)

    def verified(self, drafted: int, accepted: int) -> None:
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.stats.passes += 1
        self.policy.record_acceptance(drafted, accepted, self.matched)
