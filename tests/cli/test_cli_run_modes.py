"""Issue 16: ``edgepack run`` as llama-cli users expect it: ``-cnv`` reads user turns
from stdin and keeps the K/V of earlier turns, ``-f`` reads the prompt from a file,
``--stats-json`` writes the statistics; a GGUF given to ``run`` and a hub id given to
``convert``/``build`` get the command that fits."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from edgepack.cli import main
from edgepack.cli.exit_codes import EXIT_USAGE
from edgepack.cli.pointers import looks_like_hub_id
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)

STATS_KEYS = {
    "prompt_tokens", "cached_prompt_tokens", "generated_tokens", "time_to_first_token",
    "prefill_seconds", "decode_seconds", "prefill_tokens_per_s", "decode_tokens_per_s",
    "kv_bytes", "peak_rss_bytes",
}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("runmodes")
    spec = TinyLlamaSpec(num_hidden_layers=1, max_position_embeddings=128)
    write_gguf_llama(d / "m.gguf", spec, tiny_llama_weights(spec))
    assert main(["convert", str(d / "m.gguf"), "-o", str(d / "a.epk"), "-q"]) == 0
    return d


def _run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str],
    stdin: str = "",
) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_conversation_reads_turns_until_exit_and_reuses_the_kv(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stats = tmp_path / "stats.json"
    args = ["run", str(work / "a.epk"), "-cnv", "--max-tokens", "3", "--json",
            "--stats-json", str(stats)]
    code, out, err = _run(capsys, monkeypatch, args, "hello\n\nand again\n/exit\nnot read\n")
    assert code == 0, err
    turns = json.loads(out)["turns"]
    assert [t["user"] for t in turns] == ["hello", "and again"]  # blank skipped, /exit ends
    first, second = (t["stats"] for t in turns)
    # the second turn's prompt is the whole conversation; its start is in the KV already
    assert second["prompt_tokens"] > first["prompt_tokens"]
    assert second["cached_prompt_tokens"] >= first["prompt_tokens"]
    assert second["kv_bytes"] > 0
    written = json.loads(stats.read_text())
    assert len(written["turns"]) == 2 and STATS_KEYS <= set(written["turns"][1])


def test_conversation_ends_at_end_of_input_and_streams_each_reply(
    work: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["run", str(work / "a.epk"), "-cnv", "--max-tokens", "2"]
    code, out, err = _run(capsys, monkeypatch, args, "one\ntwo\nthree")  # no final newline
    assert code == 0, err
    assert out.count("\n") == 3  # three replies, each ended by a newline
    assert err.count("prompt tokens (") >= 3  # one statistics line a turn (and a summary)


def test_prompt_file_is_the_prompt(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "p.txt").write_text("the quick brown", encoding="utf-8")
    stats = tmp_path / "s.json"
    base = ["run", str(work / "a.epk"), "--max-tokens", "4", "-q"]
    code, from_file, err = _run(
        capsys, monkeypatch, [*base, "-f", str(tmp_path / "p.txt"), "--stats-json", str(stats)]
    )
    assert code == 0, err
    code, from_flag, err = _run(capsys, monkeypatch, [*base, "-p", "the quick brown"])
    assert code == 0, err
    assert from_file == from_flag and from_file.strip()
    doc = json.loads(stats.read_text())
    assert STATS_KEYS <= set(doc) and doc["prompt_tokens"] > 0


@pytest.mark.parametrize(
    "args",
    [
        ["-p", "x", "-f", "FILE"],  # two prompts
        [],  # no prompt and no conversation
    ],
)
def test_prompt_usage_errors(
    args: list[str], work: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = [str(work / "a.epk") if a == "FILE" else a for a in args]
    code, _, err = _run(capsys, monkeypatch, ["run", str(work / "a.epk"), *args])
    assert code == EXIT_USAGE and ("-f/--file" in err or "give the prompt" in err), err


def test_gguf_given_to_run_points_to_convert(
    work: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = _run(capsys, monkeypatch, ["run", str(work / "m.gguf"), "-p", "hi"])
    assert code == EXIT_USAGE
    assert "is a GGUF file" in err and "edgepack convert" in err and "edgepack build" in err


@pytest.mark.parametrize("command", ["convert", "build"])
def test_hub_id_points_to_a_download(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    args = [command, "HuggingFaceTB/SmolLM2-135M", "-o", "x.epk"]
    code, _, err = _run(capsys, monkeypatch, args)
    assert code == EXIT_USAGE
    assert "huggingface-cli download HuggingFaceTB/SmolLM2-135M" in err
    assert "fetch-sample" in err


def test_hub_id_detection() -> None:
    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert looks_like_hub_id("https://huggingface.co/org/model") == "org/model"
    for path in ("model.gguf", "./org/model", "/abs/model", "a/b/c", "../x/y"):
        assert looks_like_hub_id(path) is None, path
