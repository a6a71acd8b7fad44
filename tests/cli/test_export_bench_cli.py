"""`edgepack export` and `edgepack bench` from the command line: what they print, the
records `bench --json` gives (llama-bench's fields; never its speed), refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from edgepack.cli import main
from edgepack.cli.exit_codes import EXIT_USAGE
from edgepack.packager.convert import convert
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)

COLUMNS = ["model", "size", "params", "backend", "threads", "test", "t/s"]


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("exportcli")
    spec = TinyLlamaSpec(num_hidden_layers=1, max_position_embeddings=64)
    write_gguf_llama(d / "m.gguf", spec, tiny_llama_weights(spec))
    out = {}
    for enc, emb in (("int4-g32", "f16"), ("int3-g32", "int3-g32")):
        out[enc] = d / f"{enc}.epk"
        convert(d / "m.gguf", out[enc], encoding=enc, embedding_encoding=emb)
    return out


def _run(capsys, args: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(args)
    got = capsys.readouterr()
    return code, got.out, got.err


def test_export_writes_gguf_and_says_what(packages, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    code, text, _ = _run(capsys, ["export", str(packages["int4-g32"]), "-o", str(out)])
    assert code == 0 and out.read_bytes()[:4] == b"GGUF"
    line = rf"wrote {re.escape(str(out))}: \d+ tensors \(.*Q4_0.*\), \d+ bytes\n"
    assert re.fullmatch(line, text)
    code, text, _ = _run(capsys, ["export", str(packages["int4-g32"]), "-o", str(out), "--json"])
    assert code == EXIT_USAGE and "--force" in json.loads(text)["error"]["message"]
    args = ["export", str(packages["int4-g32"]), "-o", str(out), "--force", "--json"]
    code, text, _ = _run(capsys, args)
    result = json.loads(text)["result"]
    assert code == 0 and result["size"] == out.stat().st_size and result["gguf_types"]["Q4_0"] > 0


def test_export_refuses_in_one_line_naming_tensor_and_encoding(packages, tmp_path, capsys):
    code, text, err = _run(capsys, ["export", str(packages["int3-g32"]), "-o", str(tmp_path / "x")])
    assert code == EXIT_USAGE and text == ""
    assert len(err.strip().splitlines()) == 1
    assert re.search(r"tensor '[\w.]+' is int3-g32, which GGUF cannot store exactly", err)
    assert not (tmp_path / "x").exists()


def test_export_help_lists_the_exportable_encodings(capsys):
    code, text, _ = _run(capsys, ["export", "--help"])
    assert code == 0 and "Exportable:" in text and "Q4_1" in text


def test_bench_prints_llama_bench_table(packages, capsys):
    args = ["bench", str(packages["int4-g32"]), "-p", "8", "-n", "3", "-r", "2", "--threads", "1"]
    code, text, _ = _run(capsys, args)
    assert code == 0
    header, rule, *rows = text.strip().splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == COLUMNS
    assert set(rule) <= set("|-: ")
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [c[COLUMNS.index("test")] for c in cells] == ["pp8", "tg3"]
    for c in cells:
        assert re.fullmatch(r"\d+\.\d\d ± \d+\.\d\d", c[-1]) and c[4] == "1"
        assert re.fullmatch(r"[\d.]+ (MiB|GiB)", c[1]) and re.fullmatch(r"[\d.]+ (M|B)", c[2])


def test_bench_json_records_have_llama_bench_fields(packages, capsys):
    args = ["bench", str(packages["int4-g32"]), "-p", "0", "-n", "2", "-r", "3", "--json"]
    code, text, _ = _run(capsys, args)
    (record,) = json.loads(text)["records"]
    assert code == 0
    assert {"model_filename", "model_type", "model_size", "model_n_params", "backend",
            "n_threads", "n_prompt", "n_gen", "test", "avg_ts", "stddev_ts",
            "samples_ts"} <= set(record)
    assert (record["test"], record["n_prompt"], record["n_gen"]) == ("tg2", 0, 2)
    assert len(record["samples_ts"]) == 3 and record["avg_ts"] > 0
    assert record["model_size"] == packages["int4-g32"].stat().st_size


def test_bench_needs_something_to_measure(packages, capsys):
    code, _, err = _run(capsys, ["bench", str(packages["int4-g32"]), "-p", "0", "-n", "0"])
    assert code == EXIT_USAGE and "nothing to measure" in err
