"""Errors a user can cause reach the CLI typed: documented exit code, one line, no
"internal error"; and the exit code table maps every error family where the README says."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgepack.cli import main
from edgepack.cli.exit_codes import (
    EXIT_CORRUPT,
    EXIT_FAILED,
    EXIT_INCOMPATIBLE,
    EXIT_SIGNATURE,
    EXIT_USAGE,
    exit_code_for,
)
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)

RECIPE = (
    '[quantize]\nencodings = ["int4", "int8"]\ngroup_sizes = [32]\n'
    "[calibration]\nsamples = 4\nmax_tokens = 32\n"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("errors")
    spec = TinyLlamaSpec(hidden_size=64, intermediate_size=128, vocab_size=288)
    gguf = root / "tiny.gguf"
    write_gguf_llama(gguf, spec, tiny_llama_weights(spec))
    quantized = root / "tiny-int8.epk"
    assert main(["convert", str(gguf), "-o", str(quantized), "--encoding", "int8"]) == 0
    recipe = root / "r.toml"
    recipe.write_text(RECIPE)
    return {"gguf": gguf, "quantized": quantized, "recipe": recipe}


def _usage_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """Run the CLI; assert exit 2 with one line on stderr; return that line."""
    capsys.readouterr()
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "internal error" not in err and "Traceback" not in err
    return err


BAD_CALIBRATION = [
    ("{nope\n", "line 1: not JSON"),
    ('{"text": "fine"}\n[1, 2]\n', "line 2: expected an object or a string"),
    ('{"n": 1}\n', "line 1: no text field"),
    ("\n\n", "no documents"),
]
BAD_LUT = [
    ("not json", "cannot read latency table"),
    ('{"format": "other"}', "is not an edgepack latency table"),
    ("[1, 2]", "is not an edgepack latency table"),
    ('{"format": "edgepack-latency-lut/1", "entries": [1]}', "is malformed"),
    ('{"format": "edgepack-latency-lut/1", "entries": {"64x64 int8": "x"}}', "is malformed"),
]
# input file name, the build arguments that use it, what every message tells the user to do
INPUTS = {
    "calib.jsonl": (["--calib"], '"text"'),
    "lut.json": (["--target-bpw", "12", "--latency-budget", "1000", "--lut"], "profile-device"),
}


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [("calib.jsonl", *case) for case in BAD_CALIBRATION] + [("lut.json", *c) for c in BAD_LUT],
)
def test_bad_input_file_is_a_usage_error(
    models: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    content: str,
    expected: str,
) -> None:
    """A bad calibration JSONL or latency LUT: exit 2, one line naming the file, the
    fault and the fix, before any work (nothing written)."""
    bad = tmp_path / name
    bad.write_text(content)
    flags, fix = INPUTS[name]
    out = tmp_path / "m.epk"
    args = ["build", str(models["gguf"]), "-o", str(out), "--recipe", str(models["recipe"])]
    err = _usage_error(capsys, [*args, *flags, str(bad)])
    assert name in err and expected in err and fix in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_quantized_source_is_a_usage_error(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.epk"
    err = _usage_error(capsys, ["build", str(models["quantized"]), "-o", str(out)])
    assert "tiny-int8.epk is already quantized" in err and "float source" in err
    assert not out.exists()


def test_exit_code_table() -> None:
    """Each error family maps to the README's code; a subclass overrides its base only
    where the table says so; anything else is a bug (None: "internal error")."""
    from edgepack.format.delta.errors import IncompatibleDeltaError, TruncatedDeltaError
    from edgepack.format.errors import EdgepackError, EncodingError, SignatureError
    from edgepack.packager import errors as perr
    from edgepack.runtime_shim.errors import KVCacheFullError
    from edgepack.server import errors as serr

    usage = [perr.RecipeError, perr.CalibrationError, perr.LatencyTableError]
    usage += [perr.QuantizedSourceError, perr.SearchError, EncodingError]
    usage += [serr.InvalidStoreURLError, serr.RepositoryNotInitializedError]
    usage += [serr.UnknownReleaseError, FileNotFoundError]
    for cls in usage:
        assert exit_code_for(cls("x")) == EXIT_USAGE, cls
    for cls in (perr.ImportModelError, TruncatedDeltaError, serr.RepositoryError):
        assert exit_code_for(cls("x")) == EXIT_CORRUPT, cls
    for cls in (SignatureError, serr.MetadataSignatureError, serr.RollbackError):
        assert exit_code_for(cls("x")) == EXIT_SIGNATURE, cls
    assert exit_code_for(IncompatibleDeltaError("x")) == EXIT_INCOMPATIBLE
    for cls in (EdgepackError, serr.StoreError, KVCacheFullError):
        assert exit_code_for(cls("x")) == EXIT_FAILED, cls
    assert exit_code_for(ValueError("x")) is None
    assert exit_code_for(KeyError("x")) is None


def test_search_error_is_an_edgepack_error_not_a_value_error() -> None:
    from edgepack.format.errors import EdgepackError
    from edgepack.packager.search import SearchError

    assert issubclass(SearchError, EdgepackError) and not issubclass(SearchError, ValueError)


def test_eval_text_shorter_than_a_chunk_is_a_usage_error(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "short.txt"
    text.write_text("a few words only")
    args = ["eval", str(models["quantized"]), "--text", str(text), "--kernels", "numpy"]
    err = _usage_error(capsys, args)
    assert "fewer than one chunk of 512" in err and "smaller ctx" in err
    capsys.readouterr()
    assert main([*args, "--ctx", "2"]) == EXIT_USAGE  # click's range check
