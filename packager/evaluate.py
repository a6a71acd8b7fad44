"""``edgepack eval``: perplexity, and KL / top-1 agreement against a reference package.

The protocol is llama.cpp's ``llama-perplexity``, so numbers compare with its table:
the whole text is tokenized once (with the model's BOS when its tokenizer adds one),
cut into non-overlapping chunks of ``ctx`` tokens (the first token of each chunk
replaced by BOS when the model uses one), each chunk is run from an empty context and
only the second half is scored: the logits at positions ``ctx/2 .. ctx-2`` predict
tokens ``ctx/2+1 .. ctx-1``. PPL is ``exp`` of the mean negative log-likelihood over
all scored tokens; with a reference, KL divergence ``KL(ref || model)`` and top-1
agreement are averaged over the same positions.

Both packages run on the runtime shim as a device would (default kernels, dynamic int8
activations for quantized weights) with a float KV cache by default, as llama.cpp's f16
KV cache is near lossless (``kv="int8"`` measures the device's cache too; with
``ref_kv="float"`` and the package as its own reference, the KV cache alone: bench/kv.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import InputError

__all__ = ["EvalResult", "default_eval_text", "evaluate", "tokenize_for_eval"]


def default_eval_text() -> str:
    """``pydoc_data.topics`` sorted keys ``[40:]`` (the bars' held-out split)."""
    import pydoc_data.topics as topics

    keys = sorted(topics.topics)
    return "\n\n".join(topics.topics[k] for k in keys[40:])


@dataclass
class EvalResult:
    ppl: float
    nll: float  # mean negative log-likelihood (nats)
    nll_stderr: float
    tokens: int  # scored tokens
    chunks: int
    ctx: int
    seconds: float
    kl_mean: float | None = None
    kl_stderr: float | None = None
    top1: float | None = None  # fraction of positions with the reference's argmax
    ref_ppl: float | None = None
    per_chunk_ppl: list[float] = field(default_factory=list)

    @property
    def ppl_stderr(self) -> float:
        return self.ppl * self.nll_stderr

    def lines(self) -> list[str]:
        out = [f"PPL {self.ppl:.4f} +/- {self.ppl_stderr:.4f}"]
        out.append(
            f"scored {self.tokens} tokens in {self.chunks} chunks of {self.ctx} "
            f"({self.seconds:.1f} s)"
        )
        if self.kl_mean is not None:
            out.append(f"reference PPL {self.ref_ppl:.4f}")
            out.append(f"mean KL {self.kl_mean:.6f} +/- {self.kl_stderr:.6f}")
            out.append(f"top-1 agreement {100 * self.top1:.3f} %")
        return out

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["ppl_stderr"] = self.ppl_stderr
        return d


def _uses_bos(model) -> int | None:
    """The BOS id when the model's tokenizer puts one first, else None."""
    tok = model.tokenizer
    bos = model.config.bos_token_id if hasattr(model.config, "bos_token_id") else None
    with_special = tok.encode("x", add_special_tokens=True)
    plain = tok.encode("x", add_special_tokens=False)
    if len(with_special) > len(plain) and with_special[0] != (plain[0] if plain else None):
        return int(with_special[0])
    if bos is not None and with_special and with_special[0] == bos and plain[:1] != [bos]:
        return int(bos)
    return None


def tokenize_for_eval(model, text: str) -> tuple[list[int], int | None]:
    """Token ids of ``text`` as llama.cpp tokenizes it, and the BOS id (or None)."""
    bos = _uses_bos(model)
    ids = model.tokenizer.encode(text, add_special_tokens=bos is not None)
    return [int(i) for i in ids], bos


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def _scored_logits(model, ids: list[int], first: int) -> np.ndarray:
    """Logits of positions ``first .. len(ids)-2`` (each predicts the next token)."""
    seq = model.new_sequence()
    try:
        if first > 0:
            model.forward(seq, ids[:first], logits="none")
        out = model.forward(seq, ids[first:], logits="all")
    finally:
        with model.lock:
            seq.release()
    return out[:-1]


class _RefCache:
    """Reference log-probabilities of scored positions, one float32 file per chunk."""

    def __init__(self, root: Path, ref_model, tokens: list[int], ctx: int, kv: str) -> None:
        import hashlib

        h = hashlib.sha256(ref_model.package.preamble.header_digest)
        h.update(np.asarray(tokens, np.int64).tobytes())
        h.update(f"{ctx}/{kv}".encode())
        self.dir = root / h.hexdigest()[:24]
        self.dir.mkdir(parents=True, exist_ok=True)

    def get(self, chunk: int) -> np.ndarray | None:
        path = self.dir / f"{chunk}.npy"
        if not path.exists():
            return None
        return np.load(path).astype(np.float64)

    def put(self, chunk: int, lp: np.ndarray) -> None:
        path = self.dir / f"{chunk}.npy"
        tmp = path.with_name(f"{chunk}.tmp.npy")
        np.save(tmp, lp.astype(np.float32))
        tmp.replace(path)


def evaluate(
    package: str | Path,
    text: str | None = None,
    *,
    ctx: int = 512,
    chunks: int | None = None,
    ref: str | Path | None = None,
    kernels: str | None = None,
    activations: str = "auto",
    kv: str = "float",
    ref_kv: str | None = None,
    threads: int | None = None,
    on_chunk: Callable[[int, int, float], None] | None = None,
    ref_cache: str | Path | None = None,
) -> EvalResult:
    """Perplexity of ``package`` on ``text`` (default: the held-out split); see the module.

    ``ref_kv``: the reference's KV cache layout (default: ``kv``).
    ``ref_cache``: a directory where the reference's scored log-probabilities are kept
    (float32, keyed by the reference's header digest, the tokens and ``ctx``), so later
    evaluations against the same reference run one model instead of two.
    """
    from edgepack.runtime_shim import open as open_model

    if ctx < 4:
        raise ValueError("ctx must be at least 4 tokens")
    text = default_eval_text() if text is None else text
    t0 = time.perf_counter()
    # a measurement of the developer's own packages: no signature to check (no warning)
    opts = {"kernels": kernels, "threads": threads, "verify": "none"}
    model = open_model(package, kv=kv, activations=activations, **opts)
    ref_model = None
    try:
        if ref is not None:
            ref_model = open_model(ref, kv=ref_kv or kv, activations="float", **opts)
        tokens, bos = tokenize_for_eval(model, text)
        n_chunks = len(tokens) // ctx
        if chunks is not None:
            n_chunks = min(n_chunks, chunks)
        if n_chunks < 1:
            raise InputError(
                f"text has {len(tokens)} tokens, fewer than one chunk of {ctx}: "
                "give a longer text or a smaller ctx"
            )
        first = ctx // 2
        cache = None
        if ref_model is not None and ref_cache is not None:
            cache = _RefCache(Path(ref_cache), ref_model, tokens, ctx, ref_kv or kv)
        nll_parts, kl_parts, top1_hits, ref_nll_parts, per_chunk = [], [], 0, [], []
        for c in range(n_chunks):
            ids = tokens[c * ctx : (c + 1) * ctx]
            if bos is not None:
                ids[0] = bos
            target = np.asarray(ids[first + 1 :])
            lp = _log_softmax(_scored_logits(model, ids, first))
            nll = -lp[np.arange(len(target)), target]
            nll_parts.append(nll)
            per_chunk.append(float(np.exp(nll.mean())))
            if ref_model is not None:
                rlp = cache.get(c) if cache is not None else None
                if rlp is None:
                    rlp = _log_softmax(_scored_logits(ref_model, ids, first))
                    if cache is not None:
                        cache.put(c, rlp)
                p = np.exp(rlp)
                kl_parts.append(np.sum(p * (rlp - lp), axis=-1))
                top1_hits += int(np.sum(rlp.argmax(axis=-1) == lp.argmax(axis=-1)))
                ref_nll_parts.append(-rlp[np.arange(len(target)), target])
            if on_chunk:
                running = float(np.exp(np.concatenate(nll_parts).mean()))
                on_chunk(c + 1, n_chunks, running)
    finally:
        model.close()
        if ref_model is not None:
            ref_model.close()
    all_nll = np.concatenate(nll_parts)
    mean = float(all_nll.mean())
    stderr = float(all_nll.std(ddof=1) / math.sqrt(all_nll.size)) if all_nll.size > 1 else 0.0
    res = EvalResult(
        ppl=math.exp(mean),
        nll=mean,
        nll_stderr=stderr,
        tokens=int(all_nll.size),
        chunks=n_chunks,
        ctx=ctx,
        seconds=time.perf_counter() - t0,
        per_chunk_ppl=per_chunk,
    )
    if kl_parts:
        kl = np.concatenate(kl_parts)
        res.kl_mean = float(kl.mean())
        res.kl_stderr = float(kl.std(ddof=1) / math.sqrt(kl.size)) if kl.size > 1 else 0.0
        res.top1 = top1_hits / all_nll.size
        res.ref_ppl = math.exp(float(np.concatenate(ref_nll_parts).mean()))
    return res
