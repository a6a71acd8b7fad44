"""`edgepack run --lookup`: the same text as without it, and the draft counts reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgepack.cli import main
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("runlookup")
    spec = TinyLlamaSpec(num_hidden_layers=1, max_position_embeddings=128)
    write_gguf_llama(d / "m.gguf", spec, tiny_llama_weights(spec))
    assert main(["convert", str(d / "m.gguf"), "-o", str(d / "a.epk"), "-q"]) == 0
    return d / "a.epk"


def _run(capsys: pytest.CaptureFixture[str], pkg: Path, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    args = ["run", str(pkg), "-p", "the cat the cat the cat the", "--max-tokens", "24"]
    code = main([*args, "--verify", "none", "--kernels", "native", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_lookup_gives_the_same_text_and_reports_drafts(
    package: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, plain, _ = _run(capsys, package, "--lookup", "off", "--json")
    assert code == 0
    code, looked, _ = _run(capsys, package, "--lookup", "--json")
    assert code == 0
    a, b = json.loads(plain), json.loads(looked)
    assert a["text"] == b["text"]
    assert a["stats"]["lookup"] == "off" and b["stats"]["lookup"] == "on"
    assert b["stats"]["drafted_tokens"] > 0
    assert b["stats"]["accepted_tokens"] <= b["stats"]["drafted_tokens"]
    code, _, err = _run(capsys, package, "--lookup")
    assert code == 0 and "prompt lookup (on):" in err and "drafted tokens accepted" in err


def test_bad_lookup_mode_is_a_usage_error(
    package: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(capsys, package, "--lookup", "sometimes")
    assert code != 0 and "sometimes" in err
