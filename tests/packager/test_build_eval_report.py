"""``build --eval``: held-out quality of the written package against the float model,
in the result, the report (Markdown and JSON) and ``--json``; the report plot and the
series it is drawn from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_fixtures import (
    calibration_text,
    convert_to,
    eval_text,
    tied_tiny_gguf,
    tiny_spec,
)

from edgepack.packager.build import build
from edgepack.packager.build.evaluate import HeldOutError
from edgepack.packager.build.report_plot import plot_series
from edgepack.packager.evaluate import evaluate
from edgepack.packager.recipe import RecipeError, parse_recipe

SPEC = tiny_spec(hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("evalreport")


@pytest.fixture(scope="module")
def gguf(root: Path) -> Path:
    return tied_tiny_gguf(root / "tiny.gguf", SPEC)


@pytest.fixture(scope="module")
def texts(root: Path) -> tuple[Path, Path]:
    calib, held = root / "calib.txt", root / "held.txt"
    calib.write_text(calibration_text()[:20000])
    held.write_text(eval_text()[:12000])
    return calib, held


def _recipe(**extra) -> dict:
    return {
        "quantize": {"encodings": ["int4", "int3", "int8"], "group_sizes": [32]},
        "calibration": {"samples": 16, "min_tokens": 8, "max_tokens": 48},
        "search": {"target_size": 100_000},
        "eval": {"ctx": 64, "chunks": 3},
        **extra,
    }


@pytest.fixture(scope="module")
def built(root: Path, gguf: Path, texts: tuple[Path, Path]):
    calib, held = texts
    return build(
        gguf, root / "mixed.epk", parse_recipe(_recipe()), calib_file=str(calib), eval_file=held
    )


def test_build_eval_matches_edgepack_eval(built, root: Path, gguf: Path, texts) -> None:
    """The build's figures are ``evaluate``'s on the same package and float reference."""
    e = built.evaluation
    assert e is not None and e.chunks == 3 and e.ctx == 64
    assert e.kl_mean > 0 and 0 < e.top1 < 1 and e.ref_ppl > 1 and e.ppl > 1
    f32 = convert_to(root, gguf, "f32", name="tiny-f32.epk")
    again = evaluate(built.path, texts[1].read_text(), ctx=64, chunks=3, ref=f32)
    assert again.ppl == pytest.approx(e.ppl, rel=1e-6)
    assert again.kl_mean == pytest.approx(e.kl_mean, rel=1e-5, abs=1e-9)
    assert again.top1 == e.top1
    assert any(line.startswith("eval on held.txt") for line in built.summary())


def test_eval_in_report_markdown_and_json(built) -> None:
    md = built.report_path.read_text()
    assert "## Held-out quality" in md and f"{built.evaluation.ppl:.4f}" in md
    doc = json.loads(built.path.with_suffix(".report.json").read_text())
    ev = doc["evaluation"]
    assert ev["ppl"] == pytest.approx(built.evaluation.ppl)
    assert ev["float_ppl"] == pytest.approx(built.evaluation.ref_ppl)
    assert ev["kl_mean"] == pytest.approx(built.evaluation.kl_mean)
    assert ev["top1"] == built.evaluation.top1
    assert ev["text"].endswith("held.txt")


def test_report_plot_png_and_series(built) -> None:
    assert built.plot_path is not None
    assert built.plot_path.read_bytes()[:8] == PNG_MAGIC
    from PIL import Image

    with Image.open(built.plot_path) as img:
        img.verify()
    s = plot_series(built, parse_recipe(_recipe()))
    assert s.chosen.kind == "chosen" and s.chosen.file_bytes == built.nbytes
    assert s.chosen.objective == pytest.approx(built.plan.objective)
    assert s.chosen.eval_kl == pytest.approx(built.evaluation.kl_mean)
    kinds = {p.kind for p in s.candidates}
    assert kinds == {"search", "uniform"}
    uniform = {p.label for p in s.candidates if p.kind == "uniform"}
    assert uniform == {"all int4-g32", "all int3-g32", "all int8"}
    sizes = [p.file_bytes for p in s.candidates if p.kind == "search"]
    assert len(sizes) >= 3 and min(sizes) < built.nbytes < max(sizes)
    assert s.target_size == 100_000 and s.target_bpw == pytest.approx(8e5 / built.params)
    # bits per layer: every weight matrix's bytes accounted for, by encoding
    total_bits = sum(sum(b.bits.values()) * b.params for b in s.layers)
    matrices = [t.name for t in built.sensitivities if len(t.shape) >= 2]
    assert total_bits == pytest.approx(8 * sum(built.plan.choices[n].nbytes for n in matrices))
    assert {b.group for b in s.layers} >= {"0", "1", "embed"}
    assert set(s.encodings) == {built.plan.choices[n].label for n in matrices}
    # the JSON report holds the same series
    doc = json.loads(built.path.with_suffix(".report.json").read_text())["plot_data"]
    assert doc["chosen"]["file_bytes"] == built.nbytes
    assert len(doc["candidates"]) == len(s.candidates)


def test_eval_refuses_the_calibration_text(root: Path, gguf: Path, texts) -> None:
    calib, _ = texts
    with pytest.raises(HeldOutError, match="calibration text"):
        build(gguf, root / "x.epk", parse_recipe(_recipe()), calib_file=str(calib),
              eval_file=calib)
    copy = root / "same-bytes.txt"
    copy.write_bytes(calib.read_bytes())
    data = _recipe(calibration={"samples": 16, "file": str(calib)})
    data["eval"]["file"] = str(copy)
    with pytest.raises(HeldOutError):
        build(gguf, root / "y.epk", parse_recipe(data))
    assert not (root / "x.epk").exists() and not (root / "y.epk").exists()


def test_eval_recipe_keys_checked() -> None:
    with pytest.raises(RecipeError, match=r"\[eval\]"):
        parse_recipe({"eval": {"ctx": 2}})
    with pytest.raises(RecipeError, match="unknown key"):
        parse_recipe({"eval": {"text": "x"}})
    assert "evaluation" not in parse_recipe({"eval": {"file": "t.txt"}}).to_json()


def test_build_cli_eval_json(root: Path, gguf: Path, texts, capsys) -> None:
    from edgepack.cli import main

    calib, held = texts
    recipe = root / "r.toml"
    recipe.write_text(
        '[quantize]\nencodings = ["int4", "int8"]\n[calibration]\nsamples = 8\n'
        "min_tokens = 8\nmax_tokens = 32\n[eval]\nctx = 64\nchunks = 2\n"
    )
    out = root / "cli.epk"
    args = ["build", str(gguf), "-o", str(out), "--recipe", str(recipe), "--calib", str(calib)]
    assert main([*args, "--eval", str(held), "--json", "--no-report"]) == 0
    doc = json.loads(capsys.readouterr().out)["result"]
    assert doc["evaluation"]["chunks"] == 2 and doc["evaluation"]["kl_mean"] >= 0
    assert main([*args, "--eval", str(calib), "--force"]) != 0
    assert "calibration text" in capsys.readouterr().err


def test_eval_text_shorter_than_a_chunk_fails_before_building(root: Path, gguf: Path) -> None:
    from edgepack.packager.errors import InputError

    short = root / "short.txt"
    short.write_text("Too short.")
    with pytest.raises(InputError, match="fewer than one chunk"):
        build(gguf, root / "z.epk", parse_recipe(_recipe()), eval_file=short)
    assert not (root / "z.epk").exists()
