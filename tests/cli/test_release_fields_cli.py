"""Issue 16 blockers on the command line: group sizes refused or fallbacks reported,
names that `publish` accepts, and `build` setting the version and runtime floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgepack.cli import main
from edgepack.format import Package, SectionKind
from edgepack.packager.encode import encoding_help
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)

SMOLLM_NAME = "Smollm2 135M 8k Lc100K Mix1 Ep2"  # general.name of the README's GGUF


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gguf as gguf_lib

    root = tmp_path_factory.mktemp("fields")
    spec = TinyLlamaSpec(hidden_size=64, intermediate_size=128, vocab_size=288)
    path = root / "tiny.gguf"
    real_add_name = gguf_lib.GGUFWriter.add_name
    try:  # the synthetic writer names it tiny-llama; the sample GGUF has a free-text name
        gguf_lib.GGUFWriter.add_name = lambda self, _name: real_add_name(self, SMOLLM_NAME)
        write_gguf_llama(path, spec, tiny_llama_weights(spec))
    finally:
        gguf_lib.GGUFWriter.add_name = real_add_name
    return path


@pytest.mark.parametrize("label", ["int4-g33", "int4-g100", "int4-g7"])
def test_convert_refuses_unlisted_group_size(
    gguf: Path, tmp_path: Path, label: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "m.epk"
    assert main(["convert", str(gguf), "-o", str(out), "--encoding", label]) == 2
    assert "group size" in capsys.readouterr().err
    assert not out.exists()


def test_convert_help_lists_the_registry_labels(capsys: pytest.CaptureFixture) -> None:
    main(["convert", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert " ".join(encoding_help().split()) in help_text


def test_convert_names_each_fallback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "odd.gguf"
    spec = TinyLlamaSpec(hidden_size=96, intermediate_size=192, vocab_size=288)
    write_gguf_llama(src, spec, tiny_llama_weights(spec))
    assert main(["convert", str(src), "-o", str(tmp_path / "m.epk"), "--encoding", "int4-g64"]) == 0
    err = capsys.readouterr().err
    assert "note: layers.0.attn_q.weight: row length 96 not divisible by 64: group 32" in err


def test_default_name_is_one_publish_accepts(gguf: Path, tmp_path: Path) -> None:
    from edgepack.server.releases.model import check_name

    out = tmp_path / "m.epk"
    assert main(["convert", str(gguf), "-o", str(out), "--encoding", "f16"]) == 0
    with Package.open(out) as pkg:
        name = pkg.header.identity.name
    assert name == "smollm2-135m-8k-lc100k-mix1-ep2"
    assert check_name("model", name) == name


def test_publish_takes_the_converted_name(gguf: Path, tmp_path: Path) -> None:
    store, keys = tmp_path / "store", tmp_path / "keys"
    assert main(["keygen", str(tmp_path / "release")]) == 0
    out = tmp_path / "m.epk"
    args = ["convert", str(gguf), "-o", str(out), "--sign-key", str(tmp_path / "release.key")]
    assert main(args) == 0
    init = ["repo", "init", "--store", str(store), "--keys-dir", str(keys)]
    assert main([*init, "--package-key", str(tmp_path / "release.pub")]) == 0
    pub = ["publish", str(out), "--store", str(store), "--keys-dir", str(keys), "--channel", "beta"]
    assert main(pub) == 0


def test_convert_model_name_option(
    gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "m.epk"
    assert main(["convert", str(gguf), "-o", str(out), "--model-name", "smol"]) == 0
    with Package.open(out) as pkg:
        assert pkg.header.identity.name == "smol"
    assert main(["convert", str(gguf), "-o", str(tmp_path / "x.epk"), "--model-name", "a b"]) == 2
    assert "model name 'a b'" in capsys.readouterr().err
    assert not (tmp_path / "x.epk").exists()


def test_build_sets_name_version_and_runtime_floor(gguf: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[quantize]\nencodings = ["int8"]\nalgorithm = "rtn"\nscale_search = false\n'
    )
    out = tmp_path / "m.epk"
    args = ["build", str(gguf), "-o", str(out), "--recipe", str(recipe), "--no-report"]
    args += ["--model-name", "smol", "--model-version", "1.2.0"]
    assert main([*args, "--min-runtime-version", "0.1.1"]) == 0
    with Package.open(out) as pkg:
        h = pkg.header
        assert (h.identity.name, h.identity.version) == ("smol", "1.2.0")
        assert h.min_runtime_version == "0.1.1"
        assert json.loads(pkg.section(SectionKind.PRECISION_PLAN))["method"]


@pytest.mark.parametrize(
    "extra", [["--model-version", "1.2"], ["--min-runtime-version", "x"], ["--model-name", "-a"]]
)
def test_build_refuses_bad_release_fields(gguf: Path, tmp_path: Path, extra: list[str]) -> None:
    assert main(["build", str(gguf), "-o", str(tmp_path / "m.epk"), *extra]) == 2
    assert not (tmp_path / "m.epk").exists()


def test_build_names_each_fallback_in_output_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    src = tmp_path / "odd.gguf"
    spec = TinyLlamaSpec(hidden_size=96, intermediate_size=192, vocab_size=288)
    write_gguf_llama(src, spec, tiny_llama_weights(spec))
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[quantize]\nencodings = ["int4-g64"]\nalgorithm = "rtn"\nscale_search = false\n'
    )
    out = tmp_path / "m.epk"
    assert main(["build", str(src), "-o", str(out), "--recipe", str(recipe)]) == 0
    note = "layers.0.attn_q.weight: row length 96 not divisible by the group of int4-g64"
    assert f"note: {note}: int8 instead" in capsys.readouterr().out
    assert note in (tmp_path / "m.report.md").read_text()
