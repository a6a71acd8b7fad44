"""A conversation with a model: its own KV sequence, generation, logits and stats.

A session keeps the K/V of what it last processed. A new prompt that starts with the
same tokens (the next chat turn) only computes the new part; otherwise the sequence is
cut back to the common prefix (copy-on-write protects blocks other sessions share) and
extended from the model-wide prefix cache where full blocks match.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepack.format.digests import sha256

from .chat import render_chat
from .errors import InvalidRequestError, KVCacheFullError
from .lookup import (
    LookupDecoder,
    LookupPolicy,
    acceptance_counts,
    batch_invariant,
    draft_ends,
    draft_sources,
    lookup_mode,
    pass_costs,
)
from .prefix_cache import NO_ADAPTER
from .sampling import Sampler, SamplingParams
from .stats import ForwardStats, GenerationStats

if TYPE_CHECKING:
    from .adapters import ActiveAdapter, AdapterHandle
    from .model import Model

__all__ = ["Session"]


class Session:
    """One conversation with a model: its own KV sequence (blocks shared copy-on-write
    with other sessions' equal prefixes), its adapter choice, and its statistics.

    ``generate`` and ``chat`` stream text; a later call whose tokens start with what the
    session already holds computes only the rest. Sessions of one model run one at a
    time (the model's lock); open several to keep several conversations.
    """

    def __init__(
        self, model: Model, adapter: AdapterHandle | None = None, adapter_scale: float = 1.0
    ) -> None:
        self.model = model
        self.adapter: ActiveAdapter | None = model._active_adapter(adapter, adapter_scale)
        self.seq = model.new_sequence(self._salt)
        self.forward_stats = ForwardStats()  # cumulative
        self.stats = GenerationStats(kernel_path=model.kernel_path, kv_mode=model.kv_mode)
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        if not self._closed:
            with self.model.lock:
                self.seq.release()
            self._closed = True

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @property
    def adapter_digest(self) -> bytes:
        """What K/V bindings (saved sessions, prefix caches) name for this session's
        adapter: none, or a digest of the adapter and its scale (both decide the K/V)."""
        if self.adapter is None:
            return NO_ADAPTER
        return sha256(self.adapter.salt).digest()

    @property
    def _salt(self) -> bytes:
        return b"" if self.adapter is None else self.adapter.salt

    def use_adapter(self, adapter: AdapterHandle | None, scale: float = 1.0) -> None:
        """Switch this session to ``adapter`` at ``scale`` (or none). The context computed
        under the previous choice is dropped (its K/V are the old adapter's); the base is
        untouched."""
        active = self.model._active_adapter(adapter, scale)
        with self.model.lock:
            self.seq.release()
            self.adapter = active
            self.seq = self.model.new_sequence(self._salt)

    def fork(self) -> Session:
        """A new session continuing from this one's context (blocks shared, COW)."""
        other = Session(self.model)
        other.adapter = self.adapter
        with self.model.lock:
            other.seq = self.seq.fork()
        return other

    @property
    def tokens(self) -> list[int]:
        return list(self.seq.tokens)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save the tokens and K/V this session holds; ``Model.restore`` continues from
        it on the same weights, adapter and KV layout only (:mod:`.session_file`)."""
        from .session_file import save_session

        return save_session(self, path)

    # -- scoring ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.model.tokenizer.encode(text)

    def logits(self, ids: str | Sequence[int]) -> np.ndarray:
        """``float32 [T, vocab]`` logits of every position of ``ids`` (from position 0,
        on a scratch sequence; this session's context is untouched)."""
        ids = self.encode(ids) if isinstance(ids, str) else [int(i) for i in ids]
        seq = self.model.new_sequence(self._salt)
        try:
            out = self.model.forward(
                seq, ids, logits="all", stats=self.forward_stats, adapter=self.adapter
            )
        finally:
            with self.model.lock:
                seq.release()
        assert out is not None
        return out

    def hidden_states(
        self, ids: Sequence[int], teacher: dict[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """Hidden states after the embedding, every layer and the final norm, plus
        ``logits``: each ``[T, ...]`` float32 (for :mod:`.compare`). With ``teacher``
        (another run's hidden states) each layer's input comes from there."""
        seq = self.model.new_sequence(self._salt)
        collect: dict[str, list[np.ndarray]] = {}
        try:
            logits = self.model.forward(
                seq,
                list(ids),
                logits="all",
                stats=self.forward_stats,
                collect=collect,
                teacher=teacher,
                adapter=self.adapter,
            )
        finally:
            with self.model.lock:
                seq.release()
        out = {k: np.concatenate(v) if len(v) > 1 else v[0] for k, v in collect.items()}
        out["logits"] = logits
        return out

    # -- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str | int] | None = None,
        *,
        repetition_penalty: float = 1.0,
        output: str | None = None,
        add_special_tokens: bool = True,
        sampling: SamplingParams | None = None,
        lookup: bool | str = "auto",
    ) -> Iterator[Any]:
        """Stream a continuation of ``prompt`` (text or token ids).

        Yields text pieces (``output="text"``, the default for a text prompt) or token
        ids (``output="ids"``, the default for an id prompt). Stops after ``max_tokens``,
        at an end-of-sequence token, at any ``stop`` string (not included in the output)
        or token id, or when the context is full. ``temperature=0`` is greedy.
        ``sampling`` (a :class:`SamplingParams`) replaces the five sampling arguments.
        ``lookup``: prompt-lookup decoding (:mod:`.lookup`), greedy only (sampling runs
        plain): ``"auto"`` (default) drafts only while it measures faster and only on
        kernels where the output stays bit for bit plain decoding's; ``True`` drafts every
        step; ``False`` never.
        ``self.stats`` describes the call once the generator is exhausted or closed.
        """
        if isinstance(prompt, str):
            ids = self.model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            mode = output or "text"
        else:
            ids = [int(i) for i in prompt]
            mode = output or "ids"
        if mode not in ("text", "ids"):
            raise ValueError("output must be 'text' or 'ids'")
        params = SamplingParams(temperature, top_k, top_p, repetition_penalty, seed)
        if sampling is not None:
            if params != SamplingParams():
                raise ValueError("give sampling= or the sampling arguments, not both")
            params = sampling
        lookup = lookup_mode(lookup)
        # the prompt's draft sources are encoded here, with it, not once the call runs: a
        # caller may release the tokenizer's encoder in between (edgepack run does)
        sources = draft_sources(self.model, ids) if self._drafts(params, lookup) else []
        return self._generate(ids, max_tokens, params, stop, mode, lookup, sources)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        max_tokens: int = 256,
        *,
        engine: str = "auto",
        **kwargs: Any,
    ) -> Iterator[Any]:
        """Render ``messages`` with the package's chat template and stream the reply."""
        text = self.render_chat(messages, engine=engine)
        ids = self.model.tokenizer.encode(text, add_special_tokens=False)
        kwargs.setdefault("output", "text")
        return self.generate(ids, max_tokens, **kwargs)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        engine: str = "auto",
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        tok = self.model.tokenizer
        cfg = self.model.config

        def token_text(tid: int | None) -> str:
            return (tok.id_to_token(tid) or "") if tid is not None else ""

        eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
        return render_chat(
            self.model.chat_template(),
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=token_text(cfg.bos_token_id),
            eos_token=token_text(eos),
            engine=engine,
        )

    def _generate(
        self,
        ids: list[int],
        max_tokens: int,
        params: SamplingParams,
        stop: str | Sequence[str | int] | None,
        mode: str,
        lookup: bool | str = False,
        sources: list[list[int]] | None = None,
    ) -> Iterator[Any]:
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        model = self.model
        stop_strings, stop_ids = _split_stops(stop)
        stop_ids |= model.stop_token_ids()
        stats = GenerationStats(
            kernel_path=model.kernel_path,
            kv_mode=model.kv_mode,
            activations="int8" if model.act_int8 else "float",
            prompt_tokens=len(ids),
        )
        self.stats = stats
        fallbacks0 = self.forward_stats.precision_fallbacks
        sampler = Sampler(params)
        t0 = time.perf_counter()
        cached = self._reuse(ids)
        stats.cached_prompt_tokens = cached
        logits = model.forward(
            self.seq, ids[cached:], stats=self.forward_stats, adapter=self.adapter
        )
        assert logits is not None
        queued: list[int] = []  # tokens chosen (the first, a verify pass's), not yet emitted
        t_decode = None
        if max_tokens > 0:
            queued.append(sampler(logits, ids))
            stats.time_to_first_token = stats.prefill_seconds = time.perf_counter() - t0
            t_decode = time.perf_counter()
        # what decoding needs is set up after the first token (it is not on its path)
        max_ctx = model.config.max_position_embeddings
        detok = model.tokenizer.stream() if mode == "text" else None
        text = ""  # generated text not yet yielded (held back for stop strings)
        hold = max((len(s) for s in stop_strings), default=1) - 1
        generated: list[int] = []
        stats.finish_reason = "length"
        lk = None
        if self._drafts(params, lookup):
            policy = LookupPolicy(
                always=lookup is True, costs=pass_costs(model), counts=acceptance_counts(model)
            )
            exact = None if lookup is True else partial(batch_invariant, model)
            ends = draft_ends(model) | stop_ids  # nothing after a stop token is generated
            lk = LookupDecoder(
                policy, ids, exact, sources=sources or [], ends=ends, stops=frozenset(stop_ids)
            )
            stats.lookup = "on" if lookup is True else "auto"
        try:
            while len(generated) < max_tokens:
                if queued:
                    tid = queued.pop(0)
                else:
                    tid = sampler(logits, ids + generated if sampler.uses_history else ())
                generated.append(tid)
                stats.generated_tokens = len(generated)
                if lk is not None:
                    lk.push(tid)
                if tid in stop_ids:
                    stats.finish_reason = "eos"
                    break
                if detok is None:
                    yield tid
                else:
                    text += detok.feed(tid)
                    cut = _find_stop(text, stop_strings)
                    if cut is not None:
                        if cut:
                            yield text[:cut]
                        text = ""
                        stats.finish_reason = "stop"
                        break
                    if len(text) > hold:
                        emit = len(text) - hold
                        yield text[:emit]
                        text = text[emit:]
                if len(generated) >= max_tokens:
                    break
                if queued:
                    continue
                if self.seq.length + 1 > max_ctx:
                    stats.finish_reason = "context"
                    break
                if lk is None:
                    logits = model.forward(
                        self.seq, [tid], stats=self.forward_stats, adapter=self.adapter
                    )
                    assert logits is not None
                else:
                    room = min(max_tokens - len(generated), max_ctx - self.seq.length) - 1
                    history = ids + generated if sampler.uses_history else []
                    logits, queued = self._lookup_step(lk, tid, history, room, sampler)
            if detok is not None and stats.finish_reason not in ("stop",):
                text += detok.flush()
                cut = _find_stop(text, stop_strings)
                if cut is not None:
                    text = text[:cut]
                    stats.finish_reason = "stop"
                if text:
                    yield text
        finally:
            if t_decode is not None:
                stats.decode_seconds = time.perf_counter() - t_decode
            stats.precision_fallbacks = self.forward_stats.precision_fallbacks - fallbacks0
            if lk is not None:
                # hold what plain decoding would: K/V of everything but the last token
                keep = len(ids) + len(generated) - 1
                if generated and self.seq.length > keep:
                    with model.lock:
                        self.seq.truncate(keep)
                stats.lookup = "off" if lk.off else stats.lookup
                stats.drafted_tokens = lk.stats.drafted
                stats.accepted_tokens = lk.stats.accepted
                stats.verify_passes = lk.stats.passes

    def _drafts(self, params: SamplingParams, lookup: bool | str) -> bool:
        """Whether a call drafts (prompt lookup): greedy only (sampling would need the
        speculative acceptance rule); "auto" only where verifying in one pass cannot
        change a logit bit."""
        if lookup is False or params.temperature != 0.0:
            return False
        return lookup is True or batch_invariant(self.model, try_passes=False)

    def _lookup_step(
        self,
        lk: LookupDecoder,
        tid: int,
        history: list[int],
        room: int,
        sampler: Sampler,
    ) -> tuple[np.ndarray | None, list[int]]:
        """Feed ``tid`` plus a draft of at most ``room`` tokens; return the logits after
        ``tid`` (no draft) or the tokens greedy decoding chooses from the pass: the
        accepted drafts and the one after them. K/V past the accepted ones is cut."""
        model = self.model
        draft = lk.propose(room)
        t0 = time.perf_counter()
        if not draft:
            logits = model.forward(self.seq, [tid], stats=self.forward_stats, adapter=self.adapter)
            lk.timed(1, time.perf_counter() - t0)
            return logits, []
        picks = sampler.greedy  # each row's argmax is all a greedy choice needs
        try:
            rows = model.forward(
                self.seq, [tid, *draft], logits="argmax" if picks else "all",
                stats=self.forward_stats, adapter=self.adapter,
            )
        except KVCacheFullError:  # drafts need a block plain decoding would not: stop them
            with model.lock:
                self.seq.truncate(self.seq.length)  # return blocks the pass reserved
            lk.off = True
            return model.forward(
                self.seq, [tid], stats=self.forward_stats, adapter=self.adapter
            ), []
        assert rows is not None
        lk.timed(len(draft) + 1, time.perf_counter() - t0)
        chosen: list[int] = []
        for j, row in enumerate(rows):
            if picks:
                chosen.append(int(row))
            else:
                chosen.append(sampler(row, history + chosen))  # history: [] unless it is used
            if j == len(draft) or chosen[-1] != draft[j]:
                break
        accepted = len(chosen) - 1
        if accepted < len(draft):
            with model.lock:
                self.seq.truncate(self.seq.length - (len(draft) - accepted))
        lk.verified(len(draft), accepted)
        return None, chosen

    def _reuse(self, ids: list[int]) -> int:
        """Keep what this session already holds of ``ids`` and attach cached blocks; at
        least one token is left to compute. Returns how many tokens need no compute."""
        limit = len(ids) - 1
        with self.model.lock:
            common = min(self.seq.common_prefix(ids), limit)
            if common < self.seq.length:
                self.seq.truncate(common)
            if self.adapter is None:  # stored prefixes hold K/V computed without one
                self.seq = self.model.prefix_store.attach(self.seq, ids, limit)
            self.seq.attach_prefix(ids, limit)
            return self.seq.length


def _split_stops(stop: str | Sequence[str | int] | None) -> tuple[list[str], set[int]]:
    if stop is None:
        return [], set()
    items = [stop] if isinstance(stop, str) else list(stop)
    strings = [s for s in items if isinstance(s, str) and s]
    ids = {int(s) for s in items if isinstance(s, (int, np.integer))}
    return strings, ids


def _find_stop(text: str, stops: list[str]) -> int | None:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best
