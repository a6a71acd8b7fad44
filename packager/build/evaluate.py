"""Phase 8, evaluate (``build --eval TEXT`` or the recipe's ``[eval] file``): the written
package against the float reference on held-out text, by :func:`..evaluate.evaluate`
(``edgepack eval``'s protocol: PPL of both, mean KL, top-1 agreement).

The data rule: a model is never scored on the text it was calibrated on (the search and
GPTQ fitted that text, so it would flatter the plan); the same file, or the same bytes
under another name, is refused before the build starts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..errors import InputError
from ..evaluate import EvalResult, evaluate
from ..recipe import Recipe
from .result import Progress
from .source import FloatModel

__all__ = ["HeldOutError", "check_eval_text", "check_held_out", "evaluate_build"]


class HeldOutError(InputError):
    """The evaluation text is the calibration text: score on text the build did not see."""


def _digest(path: Path) -> bytes:
    return hashlib.sha256(path.read_bytes()).digest()


def check_held_out(eval_file: str | Path, calib_file: str | Path | None) -> Path:
    """The evaluation file, checked readable and not the calibration file (same path or
    same bytes)."""
    ev = Path(eval_file)
    if not ev.is_file():
        raise InputError(f"evaluation text {ev} is not a readable file")
    if calib_file:
        cal = Path(calib_file)
        if ev.resolve() == cal.resolve() or (cal.is_file() and _digest(ev) == _digest(cal)):
            raise HeldOutError(
                f"evaluation text {ev.name} is the calibration text {cal.name}: "
                "give held-out text the build did not calibrate on"
            )
    return ev


def check_eval_text(fm: FloatModel, eval_file: Path, recipe: Recipe) -> None:
    """Refuse, before minutes of building, a model without a tokenizer or a text shorter
    than one chunk of ``[eval] ctx`` tokens."""
    from edgepack.runtime_shim import Tokenizer

    if fm.tokenizer_json is None:
        raise InputError("--eval needs the model's tokenizer and the source has none")
    text = eval_file.read_text(encoding="utf-8")
    n = len(Tokenizer.from_json(fm.tokenizer_json).encode(text, add_special_tokens=True))
    if n < recipe.evaluation.ctx:
        raise InputError(
            f"evaluation text {eval_file.name} has {n} tokens, fewer than one chunk of "
            f"{recipe.evaluation.ctx}: give a longer text or a smaller [eval] ctx"
        )


def evaluate_build(
    fm: FloatModel, out: Path, recipe: Recipe, eval_file: Path, progress: Progress
) -> EvalResult:
    """``out`` scored against the float reference (written now if the build had none)."""
    spec = recipe.evaluation
    fm.ensure_model(out.parent, progress)
    fm.release_model()  # evaluate opens the reference itself
    assert fm.path is not None
    text = eval_file.read_text(encoding="utf-8")
    started = False

    def on_chunk(i: int, n: int, ppl: float) -> None:
        nonlocal started
        if not started:
            progress.phase("evaluate", n)
            started = True
        progress.advance(1, f"PPL {ppl:.3f}")

    return evaluate(
        out,
        text,
        ctx=spec.ctx,
        chunks=spec.chunks or None,
        ref=fm.path,
        on_chunk=on_chunk,
    )
