"""``open()`` and the Llama-family decoder running straight from a package's mmap.

The forward pass is orchestration only: per layer it calls ``kernels.decoder_layer``
(see :mod:`.kernels`) and, when that reports an activation-scale overflow or a
non-finite value on the int8-activation path, recomputes the layer on the
float-activation path and counts the event (:class:`~.stats.ForwardStats`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgepack.format import Package, SectionKind
from edgepack.format.compat import CompatibilityProblem, CompatibilityVerdict
from edgepack.format.errors import IncompatiblePackageError
from edgepack.format.signing import (
    check_threshold,
    load_public_key,
    unchecked_signature_warning,
    verify_signature_block,
)

from .adapters import ActiveAdapter, AdapterHandle
from .capabilities import runtime_capabilities
from .config import LlamaConfig, RopeTable
from .errors import InvalidRequestError, NumericError
from .heap import release_freed_memory
from .huge_pages import map_weights_huge
from .integrity import check_weights
from .kernels import (
    Fallback,
    Kernels,
    LayerContext,
    select_kernels,
    with_float_activations,
)
from .kernels.layer_buffers import LayerShape
from .kv_cache import KVCacheConfig, KVPool
from .kv_cache import Sequence as KVSequence
from .layer_arena import ModelArena
from .prefix_cache import PrefixStore
from .stats import ForwardStats
from .weights import LayerWeights, ModelWeights, bind_weights

__all__ = ["ACT_MODES", "VERIFY_MODES", "Model", "open"]

_log = logging.getLogger("edgepack.runtime")

VERIFY_MODES = ("signature", "full", "none")
ACT_MODES = ("auto", "int8", "float")
INJECT_ENV = "EDGEPACK_INJECT_OVERFLOW"  # test hook: "3,7" or "all"
# A forward whose hidden states ([tokens, hidden] float32) reach this many bytes frees
# prompt-sized buffers (its chunks' activations, the kernels' outputs) that the heap would
# otherwise keep resident through decode: they are handed back to the OS after it, and
# before each chunk's layers run (the embedding lookup's temporaries, the previous chunk's).
_RELEASE_AFTER_BYTES = 1 << 20
_END_TOKENS = frozenset(
    {"<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|endoftext|>", "<|end|>"}
)


def open(
    path: str | os.PathLike[str],
    trusted_keys: Iterable[Any] | None = None,
    threads: int | None = None,
    kv: str = "int8",
    kernels: str | None = None,
    *,
    verify: str = "signature",
    threshold: int = 1,
    require_signature: bool = False,
    integrity_records: str | os.PathLike[str] | None = None,
    activations: str = "auto",
    kv_budget_bytes: int = 128 * 1024 * 1024,
    kv_block_size: int = 16,
    prefill_chunk: int = 512,
) -> Model:
    """Open a package for inference; weights stay in the read-only mmap.

    * Compatibility with this runtime (:func:`runtime_capabilities`) is always checked:
      :class:`~edgepack.format.errors.IncompatiblePackageError` says what to do.
    * ``trusted_keys``: Ed25519 public keys (objects or ``.pub`` paths). ``verify``:
      ``"signature"`` (default) checks that ``threshold`` (at least 1) trusted keys signed
      the header digest and hashes every tensor against the header before any is used
      (:func:`.integrity.verify_weights`, on all CPUs; the README states the cost), unless
      ``integrity_records`` holds a record that this very file was fully verified
      (:func:`.integrity.record_verified`); ``"full"`` always hashes every tensor and
      section; ``"none"`` checks nothing (not allowed together with ``trusted_keys``).
      Without trusted keys one warning is logged, or with ``require_signature`` a
      :class:`~edgepack.format.errors.SignatureError` is raised.
    * ``threads``: worker threads of the kernels and of hashing (default: all CPUs).
    * ``kv``: a layout of :data:`~.kv_cache.KV_LAYOUTS` (default ``"int8"``; the table
      there says what each stores and what it was measured to cost), ``"float"``: reference.
    * ``kernels``: ``"numpy"``, ``"native"`` or None (``$EDGEPACK_KERNELS``, else auto).
    * ``activations``: ``"int8"`` (dynamic int8 activations into quantized matmuls, the
      native kernels' scheme), ``"float"``, or ``"auto"`` (int8 iff weights are quantized).
    * Stored prefix KV caches are hash-checked and kept when bound to this model and
      session layout, else ignored with one warning (:mod:`.prefix_cache`).
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if activations not in ACT_MODES:
        raise ValueError(f"activations must be one of {ACT_MODES}, got {activations!r}")
    check_threshold(threshold)
    keys = load_trusted_keys(trusted_keys)
    if keys is not None and verify == "none":
        raise InvalidRequestError("trusted keys given with verify none: nothing would check them")
    if keys is None and (verify != "none" or require_signature):
        _log.warning(unchecked_signature_warning(f"{path}", require_signature=require_signature))
    kv_config = KVCacheConfig(mode=kv, block_size=kv_block_size, budget_bytes=kv_budget_bytes)
    pkg = Package.open(path, capabilities=runtime_capabilities())
    try:
        _log.debug("weights of %s in 2 MiB pages: %s", path, map_weights_huge(pkg))
        if verify == "full":
            pkg.verify(keys, threshold=threshold)
        elif verify == "signature":
            if keys is not None:
                verify_signature_block(
                    pkg.signature_block(), pkg.preamble.header_digest, keys, threshold
                )
            how = check_weights(pkg, integrity_records, threads)
            _log.debug("weights of %s: %s", path, how)
        if verify != "none":  # a hash pass leaves the whole file resident: let the
            pkg.release_resident_pages()  # layers fault it back in as they read it
        arch = pkg.header.identity.architecture
        if arch != "llama":
            problem = CompatibilityProblem(
                "architecture",
                f"architecture {arch!r} is not one this runtime runs (llama family only)",
                "fetch a package of a supported model",
            )
            verdict = CompatibilityVerdict((problem,))
            raise IncompatiblePackageError(verdict.summary(), verdict)
        cfg = LlamaConfig.from_dict(pkg.header.identity.config)
        weights = bind_weights(pkg, cfg)
        k = select_kernels(kernels, threads)
    except BaseException:
        pkg.close()
        raise
    model = Model(pkg, cfg, weights, k, kv_config, activations, prefill_chunk)
    model.adapter_trust = (keys, threshold, require_signature)
    return model


def load_trusted_keys(trusted_keys: Iterable[Any] | None) -> list[Any] | None:
    """Public key objects from objects or ``.pub`` paths (None: no keys given)."""
    if trusted_keys is None:
        return None
    out = []
    for key in trusted_keys:
        out.append(load_public_key(key) if isinstance(key, (str, Path)) else key)
    return out


def _inject_layers(num_layers: int) -> set[int]:
    spec = os.environ.get(INJECT_ENV, "").strip()
    if not spec:
        return set()
    if spec == "all":
        return set(range(num_layers))
    return {int(p) for p in spec.split(",") if p.strip()}


class Model:
    """An opened package. Make :meth:`session` objects to generate; the KV pool (and its
    prefix cache) is shared by all sessions of a model. Sessions may be used from
    different threads: forward passes are serialized by ``Model.lock``."""

    def __init__(
        self,
        pkg: Package,
        cfg: LlamaConfig,
        weights: ModelWeights,
        kernels: Kernels,
        kv_config: KVCacheConfig,
        activations: str = "auto",
        prefill_chunk: int = 512,
    ) -> None:
        self.package = pkg
        self.config = cfg
        self.weights = weights
        self.kernels = kernels
        self.act_int8 = activations == "int8" or (activations == "auto" and weights.is_quantized)
        self.prefill_chunk = max(1, prefill_chunk)
        salt = pkg.preamble.header_digest
        self.kv_pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_config, salt=salt)
        self.rope = RopeTable(cfg.inv_freq(weights.rope_freqs), cfg.rope_attention_scaling)
        self.inject_overflow_layers: set[int] = _inject_layers(cfg.num_layers)
        # the kernels' one-call forward (decoder_stack) where they have one; False: layer by
        # layer through decoder_layer, the reference it must match
        self.one_call = True
        # one forward pass at a time; sessions may live on different threads
        self.lock = threading.RLock()
        self._tokenizer = None
        self._default_session = None
        self._warned_nonfinite = False
        self._stop_ids: set[int] | None = None
        self._unread_stats = ForwardStats()  # of forward calls given none (not one per call)
        self.adapters: list[AdapterHandle] = []  # loaded by load_adapter, any session's pick
        # (trusted keys, threshold, require_signature) adapter-only packages are checked with
        self.adapter_trust: tuple[list[Any] | None, int, bool] = (None, 1, False)
        kernels.bind([lin for layer in weights.layers for lin in layer.linears])
        kernels.bind([weights.output])
        try:  # stored prefix KV caches: hash-checked, bound to this model, or ignored
            shape = LayerShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            self.arena = ModelArena(
                weights.layers, shape, self.prefill_chunk, self.act_int8, kernels
            )
            self.prefix_store = PrefixStore.load(self)
        except BaseException:
            self.close()
            raise
        # binding read a few bytes of every tensor: in 2 MiB pages that is the whole file
        # resident before a token is encoded; the layers fault their pages back as they run
        pkg.release_resident_pages()
        _log.info(
            "model %s: %d layers, kv %s, activations %s, kernels %s",
            pkg.header.identity.name,
            cfg.num_layers,
            kv_config.mode,
            "int8" if self.act_int8 else "float",
            kernels.name,
        )

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        self.kernels.close()
        self.package.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def kernel_path(self) -> str:
        return self.kernels.name

    @property
    def weights_mapped_bytes(self) -> int:
        """Bytes of tensor data in the package's mapping: the weights, read in place (the
        file's other bytes, its header and sections, are not weights)."""
        return sum(t.nbytes for t in self.package.header.tensors)

    @property
    def kv_mode(self) -> str:
        return self.kv_pool.mode

    # -- text ------------------------------------------------------------------------------
    @property
    def tokenizer(self):  # -> Tokenizer; lazily built (the tokenizers package is heavy)
        if self._tokenizer is None:
            from .tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_package(self.package)
            release_freed_memory()  # the build's temporaries: ~20 MiB on a 49k vocabulary
        return self._tokenizer

    def chat_template(self) -> str | None:
        raw = self.package.section(SectionKind.CHAT_TEMPLATE)
        return raw.decode("utf-8") if raw is not None else None

    def stop_token_ids(self) -> set[int]:
        """End-of-sequence ids: the config's, plus special end-of-turn tokens the
        tokenizer defines: the built tokenizer's when text came in, else read from its
        JSON (generating from ids needs no tokenizer library)."""
        if self._stop_ids is None:
            ids = set(self.config.eos_token_ids)
            for tid, text in self._special_tokens().items():
                if text in _END_TOKENS:
                    ids.add(tid)
            self._stop_ids = ids
        return set(self._stop_ids)

    def _special_tokens(self) -> dict[int, str]:
        from .tokenizer import special_tokens

        if self._tokenizer is not None:
            return self._tokenizer.special_tokens()
        raw = self.package.section(SectionKind.TOKENIZER)
        if raw is None:
            return {}
        try:
            return special_tokens(json.loads(raw))
        except (ValueError, TypeError, KeyError, AttributeError):
            return {}
        finally:
            release_freed_memory()  # the parsed JSON of the whole vocabulary

    # -- adapters --------------------------------------------------------------------------
    def load_adapter(
        self, source: str | os.PathLike[str] | None = None, *, name: str | None = None
    ) -> AdapterHandle:
        """Load a LoRA adapter for sessions to pick (``session(adapter=handle)``): a
        LORA_ADAPTER section of this model's package (``source`` None) or of the package at
        ``source`` (an adapter-only one), named ``name`` when there are several. Refused
        (:class:`~edgepack.format.errors.AdapterMismatchError`) unless made for these
        weights. The base is not read again: the adapter's factors are all it holds."""
        from .adapters_loading import load_adapter

        handle = load_adapter(self, source, name)
        self.adapters.append(handle)
        return handle

    def _active_adapter(self, handle: AdapterHandle | None, scale: float) -> ActiveAdapter | None:
        if handle is None:
            return None
        if not any(h is handle for h in self.adapters):
            raise InvalidRequestError(f"adapter {handle.name!r} was not loaded by this model")
        return ActiveAdapter.of(handle, float(scale), self.config.num_layers)

    # -- sessions --------------------------------------------------------------------------
    def session(self, adapter: AdapterHandle | None = None, adapter_scale: float = 1.0):
        """A new :class:`~.session.Session`, with ``adapter`` (a :meth:`load_adapter`
        handle) applied at ``adapter_scale``, or none."""
        from .session import Session

        return Session(self, adapter, adapter_scale)

    def restore(
        self,
        path: str | os.PathLike[str],
        adapter: AdapterHandle | None = None,
        adapter_scale: float = 1.0,
    ):  # -> Session
        """A session continuing from one saved with ``Session.save`` (refused with
        :class:`~.errors.SessionMismatchError` if saved for other weights, another
        adapter or scale, or another KV layout)."""
        from .session_file import restore_session

        return restore_session(self, path, adapter, adapter_scale)

    def _session(self):
        if self._default_session is None:
            self._default_session = self.session()
        return self._default_session

    def generate(self, prompt: str | Sequence[int], **kwargs: Any):
        """``self.session().generate`` on a default session (see :class:`~.session.Session`)."""
        return self._session().generate(prompt, **kwargs)

    def chat(self, messages: Sequence[dict[str, str]], **kwargs: Any):
        return self._session().chat(messages, **kwargs)

    def logits(self, ids: str | Sequence[int]) -> np.ndarray:
        return self._session().logits(ids)

    # -- forward ---------------------------------------------------------------------------
    def forward(
        self,
        seq: KVSequence,
        tokens: Sequence[int],
        *,
        logits: str = "last",
        stats: ForwardStats | None = None,
        collect: dict[str, list[np.ndarray]] | None = None,
        teacher: dict[str, np.ndarray] | None = None,
        adapter: ActiveAdapter | None = None,
    ) -> np.ndarray | None:
        """Run ``tokens`` after what ``seq`` holds, writing their K/V into it.

        ``logits``: ``"last"`` (``[vocab]`` of the last token), ``"all"`` (``[T, vocab]``),
        ``"argmax"`` (int64 ``[T]``: each row of ``"all"``'s float32 argmax, the first
        maximum; a greedy verify pass needs no more) or ``"none"``. ``collect`` receives
        the hidden states (``embed``, ``layers.i``, ``norm``); with ``teacher`` (such
        hidden states of another run over the same tokens) every layer takes its input
        from there instead of the previous layer (per-layer error without accumulation;
        the final norm and head take this run's last layer). Both serve :mod:`.compare`.
        ``adapter``: the session's LoRA adapter.
        """
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("forward needs at least one token")
        if seq.length + len(tokens) > self.config.max_position_embeddings:
            raise InvalidRequestError(
                f"context of {seq.length + len(tokens)} tokens exceeds the model's "
                f"{self.config.max_position_embeddings}"
            )
        trim = len(tokens) * self.config.hidden_size * 4 >= _RELEASE_AFTER_BYTES
        with self.lock:
            if stats is None:
                stats = self._unread_stats
            try:
                return self._forward(seq, tokens, logits, stats, collect, teacher, adapter, trim)
            finally:
                if trim:
                    release_freed_memory()

    def _forward(
        self,
        seq: KVSequence,
        tokens: list[int],
        logits: str,
        stats: ForwardStats,
        collect: dict[str, list[np.ndarray]] | None,
        teacher: dict[str, np.ndarray] | None,
        adapter: ActiveAdapter | None = None,
        trim: bool = False,
    ) -> np.ndarray | None:
        outs = []
        step = self.prefill_chunk
        every_row = logits in ("all", "argmax")
        for c0 in range(0, len(tokens), step):
            chunk = tokens[c0 : c0 + step]
            last_chunk = c0 + step >= len(tokens)
            forced = None
            if teacher is not None:
                forced = {k: v[c0 : c0 + len(chunk)] for k, v in teacher.items()}
            rows = len(chunk) if every_row else int(logits == "last" and last_chunk)
            picks = None  # the one call's argmax is of the raw logits: none to soft-cap
            if logits == "argmax" and self.config.final_softcap is None:
                picks = np.empty(len(chunk), np.int64)
            x, projected = self._forward_chunk(
                seq, chunk, stats, collect, forced, adapter, rows, picks, trim
            )
            if logits == "argmax":
                native = projected is not None and picks is not None
                outs.append(picks if native else self._head(x, stats, projected).argmax(-1))
            elif logits == "all":
                outs.append(self._head(x, stats, projected))
            elif rows:
                return self._head(x[-1:], stats, projected)[0]
            del x, projected  # this chunk's activations go before the next one's come
        if every_row:
            return np.concatenate(outs) if len(outs) > 1 else outs[0]
        return None

    def _forward_chunk(
        self,
        seq: KVSequence,
        chunk: list[int],
        stats: ForwardStats,
        collect: dict[str, list[np.ndarray]] | None,
        teacher: dict[str, np.ndarray] | None = None,
        adapter: ActiveAdapter | None = None,
        rows: int = 0,
        picks: np.ndarray | None = None,
        trim: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The chunk's final-normed hidden states and, when the kernels' one-call forward
        ran it all and ``rows`` asks for it, the head's logits of its last ``rows`` rows
        (their argmax then in ``picks``, when given). ``trim``: the freed heap goes back to
        the OS before the layers run (a prompt-sized forward: its peak is theirs)."""
        cfg, k = self.config, self.kernels
        start = seq.length
        seq.reserve(chunk)
        positions = np.arange(start, start + len(chunk), dtype=np.int64)
        n_ctx = start + len(chunk)
        table = seq.block_table(n_ctx)
        cos, sin = self.rope.lookup(positions)
        x = self.weights.embed.lookup(chunk)
        if trim:  # the lookup's temporaries and the previous chunk's, before the layers run
            release_freed_memory()
        if cfg.embedding_scale is not None:  # float32, as transformers' Gemma scales them
            x = x * np.float32(cfg.embedding_scale)
        if collect is not None:
            collect.setdefault("embed", []).append(x)
        inject = self.inject_overflow_layers
        arena = self.arena.native_for(adapter)
        layers, kvs = self.weights.layers, self.kv_pool.layers()

        def ctx_of(lw: LayerWeights) -> LayerContext:
            return LayerContext(
                num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                eps=cfg.rms_norm_eps,
                cos=cos,
                sin=sin,
                positions=positions,
                block_table=table,
                n_ctx=n_ctx,
                kv=kvs[lw.index],
                act_int8=self.act_int8,
                inject_overflow=lw.index in inject,
                activation=cfg.hidden_act,
                window=cfg.windows[lw.index],
                attn_scale=cfg.attention_scale,
                attn_softcap=cfg.attn_softcap,
                lora=None if adapter is None else adapter.layers[lw.index],
                arena=arena,
            )

        done, last = 0, None
        stack = getattr(k, "decoder_stack", None)  # kernels without it run layer by layer
        one_call = self.one_call and teacher is None and collect is None and not inject
        if stack is not None and one_call:
            loras = None if adapter is None else adapter.layers
            head, ctx = rows > 0, ctx_of(layers[0])
            res = stack(self.weights, x, ctx, kvs, cfg.windows, head, loras, max(rows, 1), picks)
            if res is not None:
                x, done, last = res
        for lw in layers[done:]:
            if teacher is not None:
                x = teacher["embed" if lw.index == 0 else f"layers.{lw.index - 1}"]
            ctx = ctx_of(lw)
            res = k.decoder_layer(lw, x, ctx)
            if res.fallback is not None and ctx.act_int8:
                stats.record_fallback(lw.index, res.fallback.value)
                _log.debug(
                    "layer %d: %s: recomputed with float activations", lw.index, res.fallback
                )
                res = k.decoder_layer(lw, x, with_float_activations(ctx))
            if res.fallback is not None:
                stats.nonfinite_outputs += 1
                if not self._warned_nonfinite:
                    self._warned_nonfinite = True
                    _log.warning("layer %d: %s on the float path too", lw.index, res.fallback)
            if res.x is None:
                raise NumericError(f"layer {lw.index} failed: {res.fallback}")
            x = res.x
            if collect is not None:
                collect.setdefault(f"layers.{lw.index}", []).append(x)
        seq.commit()
        if done < len(layers):  # else the one-call forward normed it
            x = k.rmsnorm(x, self.weights.norm, cfg.rms_norm_eps)
        if collect is not None:
            collect.setdefault("norm", []).append(x)
        return x, last

    def _head(
        self, x: np.ndarray, stats: ForwardStats, projected: np.ndarray | None = None
    ) -> np.ndarray:
        """Logits from final-normed hidden states ``x: [T, hidden]`` (``projected``: the
        head's output for them, already computed)."""
        logits = self._project_head(x, stats) if projected is None else projected
        cap = self.config.final_softcap
        if cap is not None:  # gemma2: cap * tanh(logits / cap), in float32
            logits /= np.float32(cap)
            np.tanh(logits, out=logits)
            logits *= np.float32(cap)
        return logits

    def _project_head(self, x: np.ndarray, stats: ForwardStats) -> np.ndarray:
        k, out = self.kernels, self.weights.output
        if self.act_int8 and out.is_quantized:
            qa = k.quantize_activations(x, out.act_group)
            if not qa.overflow:
                return k.matmul(qa, out)
            stats.record_fallback("head", Fallback.HEAD_INPUT.value)
        return k.matmul(x, out)

    def new_sequence(self, salt: bytes = b"") -> KVSequence:
        return self.kv_pool.sequence(salt)
