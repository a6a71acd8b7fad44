"""`edgepack build`, `eval` and `profile-device` from the command line (tiny models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgepack.cli import main
from edgepack.format import Package, SectionKind
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    spec = TinyLlamaSpec(hidden_size=64, intermediate_size=128, vocab_size=288)
    path = root / "tiny.gguf"
    write_gguf_llama(path, spec, tiny_llama_weights(spec))
    return path


def test_build_eval_profile(gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[quantize]\nencodings = ["int4", "int8"]\ngroup_sizes = [32]\n'
        "[calibration]\nsamples = 16\nmax_tokens = 48\n"
    )
    out = tmp_path / "m.epk"
    assert (
        main(["build", str(gguf), "-o", str(out), "--recipe", str(recipe), "--target-bpw", "12"])
        == 0
    )
    text = capsys.readouterr().out
    assert "wrote" in text and "bits/weight" in text and "peak RSS" in text
    assert out.exists() and (tmp_path / "m.report.md").exists()
    with Package.open(out) as pkg:
        plan = json.loads(pkg.section(SectionKind.PRECISION_PLAN))
        assert plan["method"] == "search"
    lut = tmp_path / "lut.json"
    assert (
        main(
            [
                "profile-device",
                "-o",
                str(lut),
                "--model",
                str(out),
                "--kernels",
                "numpy",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    assert json.loads(lut.read_text())["format"] == "edgepack-latency-lut/1"
    budget_out = tmp_path / "fast.epk"
    args = ["build", str(gguf), "-o", str(budget_out), "--recipe", str(recipe), "--no-report"]
    args += ["--target-bpw", "12", "--lut", str(lut), "--latency-budget", "1000"]
    assert main(args) == 0
    assert "predicted decode latency" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra",
    [
        ["--target-bpw", "4", "--target-size", "1000"],
        ["--latency-budget", "5"],
        ["--recipe", "/nonexistent.toml"],
    ],
)
def test_build_usage_errors(gguf: Path, tmp_path: Path, extra: list[str]) -> None:
    assert main(["build", str(gguf), "-o", str(tmp_path / "x.epk"), *extra]) == 2


def test_bad_recipe_exit_code(gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[quantize]\nencodings = ["int7"]\n')
    assert main(["build", str(gguf), "-o", str(tmp_path / "x.epk"), "--recipe", str(bad)]) == 2


def test_impossible_budget_refused_before_calibration(
    gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A size budget below every tensor's smallest candidate is a usage error (exit 2)
    found before any calibration, with what to change; nothing is left behind."""
    import edgepack.packager.build.pipeline as build_mod

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated for an impossible budget")

    monkeypatch.setattr(build_mod, "calibrate", no_calibration)
    recipe = tmp_path / "r.toml"
    recipe.write_text('[quantize]\nencodings = ["int3"]\ngroup_sizes = [32]\n')
    out = tmp_path / "m.epk"
    args = ["build", str(gguf), "-o", str(out), "--recipe", str(recipe), "--target-bpw", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "smallest possible" in err and "int3-g32" in err and "internal error" not in err
    assert list(tmp_path.iterdir()) == [recipe]
