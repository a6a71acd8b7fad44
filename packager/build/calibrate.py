"""Phase 2, calibrate: tokenize the calibration text, cut mixed-length samples and
stream them through the runtime's float path (:mod:`..calibration`)."""

from __future__ import annotations

from ..calibration import CalibrationStats, calibration_texts, collect_statistics, make_samples
from ..errors import CalibrationError
from ..recipe import Recipe
from .result import Progress
from .source import FloatModel

__all__ = ["calibrate", "probe_ids"]

_PROBE_TOKENS = 192


def calibrate(
    fm: FloatModel, recipe: Recipe, calib_file: str | None, progress: Progress
) -> tuple[CalibrationStats, list[list[int]]]:
    from edgepack.runtime_shim import Tokenizer

    if fm.tokenizer_json is None:
        raise CalibrationError(
            "calibration needs the model's tokenizer and the source has none: build from a "
            "source with one (an HF directory with tokenizer.json, or a GGUF file)"
        )
    spec = recipe.calibration
    path = calib_file or spec.file
    tok = Tokenizer.from_json(fm.tokenizer_json)
    docs = [tok.encode(d, add_special_tokens=False) for d in calibration_texts(path)]
    with_special = tok.encode("x", add_special_tokens=True)
    plain = tok.encode("x", add_special_tokens=False)
    bos = with_special[0] if len(with_special) > len(plain) else None
    samples = make_samples(docs, spec.samples, spec.min_tokens, spec.max_tokens, spec.seed, bos)
    progress.phase("calibrate", len(samples))
    stats = collect_statistics(
        fm.model,
        samples,
        seed=spec.seed,
        on_sample=lambda i, n: progress.advance(1, f"{n} tokens"),
        text_source=str(path) if path else "pydoc_data.topics keys[:40]",
    )
    return stats, samples


def probe_ids(samples: list[list[int]], tokens: int = _PROBE_TOKENS) -> list[list[int]]:
    """The longest calibration samples, up to ``tokens`` tokens in all."""
    out: list[list[int]] = []
    n = 0
    for s in sorted(samples, key=len, reverse=True):
        if n >= tokens:
            break
        out.append(s[: tokens - n])
        n += len(out[-1])
    return out

