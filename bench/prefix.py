"""Time to first token with a stored prefix KV cache against without, SmolLM2-135M int4.

    python bench/prefix.py [--int4 PKG] [--tokens 300] [--runs 5] [--threads 2]

A ~300-token system prompt is stored in a copy of the int4-g32 package
(``edgepack.packager.prefix.add_prefix_caches``: computed by the runtime on the package
itself). Each run asks the same chat (system prompt + a short question) of both, one
after the other, on fresh sessions with the model-wide block cache cleared (so the
uncached side really prefills everything), and times the first token. Prints the
medians, ``TTFT ratio N`` (uncached / cached), and ``identical`` when the next-token
logits after the prompt are bit-identical on both paths (same kernels).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

import numpy as np

QUESTION = "In one sentence: what does this text say about classes?"


def _cache_dir() -> Path:
    from edgepack.packager.sample_models import default_cache_dir

    return Path(default_cache_dir())


def _base_package(given: Path | None) -> Path:
    if given is not None:
        return given
    from edgepack.packager.convert import convert
    from edgepack.packager.sample_models import fetch_smollm2

    cache = _cache_dir()
    path = cache / "bench-runtime" / "smollm2-int4-g32.epk"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"converting the sample -> {path} ...", file=sys.stderr)
        convert(fetch_smollm2(cache), path, encoding="int4-g32")
    return path


def _system_prompt(model, n_tokens: int) -> str:
    """Documentation text cut to about ``n_tokens`` tokens once rendered."""
    import pydoc_data.topics as topics

    text = topics.topics["class"]
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    return model.tokenizer.decode(ids[: n_tokens - 8])  # the template adds a few


def _ttft(model, messages: list[dict[str, str]]) -> tuple[float, int]:
    with model.lock:
        model.kv_pool.clear_cache()
    with model.session() as s:
        list(s.chat(messages, max_tokens=1))
        return s.stats.time_to_first_token, s.stats.cached_prompt_tokens


def _next_logits(model, ids: list[int]) -> np.ndarray:
    seq = model.new_sequence()
    with model.lock:
        seq = model.prefix_store.attach(seq, ids, len(ids) - 1)
    try:
        return model.forward(seq, ids[seq.length :])
    finally:
        with model.lock:
            seq.release()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--int4", type=Path, help="int4-g32 package (default: convert the sample)")
    ap.add_argument("--tokens", type=int, default=300, help="system prompt length")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from edgepack import runtime_shim as rt
    from edgepack.packager.prefix import add_prefix_caches

    base = _base_package(args.int4)
    plain = rt.open(base, threads=args.threads, verify="none")
    system = _system_prompt(plain, args.tokens)
    cached_path = _cache_dir() / "bench-prefix" / f"{base.stem}-prefix{args.tokens}.epk"
    cached_path.parent.mkdir(parents=True, exist_ok=True)
    infos = add_prefix_caches(base, cached_path, [system], system=True)
    cached = rt.open(cached_path, threads=args.threads, verify="none")
    assert plain.kernel_path == cached.kernel_path
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    with plain.session() as s:
        ids = plain.tokenizer.encode(s.render_chat(messages), add_special_tokens=False)
    info = infos[0]
    print(f"system prompt {info.tokens} tokens ({info.nbytes:,} bytes of K/V stored), "
          f"prompt {len(ids)} tokens, kernels {plain.kernel_path}")
    with_cache, without = [], []
    for _ in range(args.runs):
        t, hit = _ttft(plain, messages)
        assert hit == 0, "the uncached side reused blocks"
        without.append(t)
        t, hit = _ttft(cached, messages)
        assert hit == info.tokens, f"the stored prefix was not used ({hit} tokens)"
        with_cache.append(t)
    a, b = statistics.median(without), statistics.median(with_cache)
    print(f"TTFT without cache {a * 1e3:.1f} ms, with stored cache {b * 1e3:.1f} ms "
          f"(median of {args.runs})")
    print(f"TTFT ratio {a / b:.1f}")
    same = np.array_equal(_next_logits(plain, ids), _next_logits(cached, ids))
    print("identical" if same else "next-token logits differ")
    plain.close()
    cached.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
