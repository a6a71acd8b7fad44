"""Every failure typed (issue 11 items 9 and 10): filesystem failures, misused run/compare
options, an unknown required feature and --json commands give one line (and, under
--json, a JSON error object on stdout) with the README's exit code, never "internal error"."""

from __future__ import annotations

import errno
import json
import mmap
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from deltafactory import write_release_pair
from pkgfactory import build_package, replace_header

from edgepack.cli import main
from edgepack.cli.exit_codes import EXIT_FAILED, EXIT_INCOMPATIBLE, EXIT_OK, EXIT_USAGE
from edgepack.format import Package
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("typed")
    write_release_pair(d, seed=9)
    for layers in (2, 3):
        spec = TinyLlamaSpec(num_hidden_layers=layers, max_position_embeddings=64)
        write_gguf_llama(d / f"l{layers}.gguf", spec, tiny_llama_weights(spec))
        args = ["convert", str(d / f"l{layers}.gguf"), "-o", str(d / f"l{layers}.epk")]
        assert main(args) == 0
    assert main(["keygen", str(d / "rel")]) == 0
    return d


def _fails(capsys: pytest.CaptureFixture[str], args: list[str], code: int) -> str:
    """Run the CLI; assert ``code`` with one error line on stderr; return that line."""
    capsys.readouterr()
    assert main(args) == code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") or err.startswith("Error: "), err
    assert "internal error" not in err and "Traceback" not in err
    return err


# ------------------------------------------------------------------ item 9: filesystem


def _patch(work: Path, out: Path) -> list[str]:
    return ["patch", str(work / "old.epk"), str(work / "d.epkd"), "-o", str(out)]


def test_output_under_a_file_is_a_usage_error(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_bytes(b"x")
    err = _fails(capsys, _patch(work, tmp_path / "file" / "out.epk"), EXIT_USAGE)
    assert "not a directory" in err


@pytest.mark.parametrize(
    ("where", "number", "says"),
    [
        ("edgepack.format.delta.apply.os.posix_fallocate", errno.ENOSPC, "No space left"),
        ("edgepack.format.delta.apply.os.fsync", errno.EIO, "Input/output error"),
        ("edgepack.format.delta.apply.create_partial", errno.EROFS, "Read-only file system"),
    ],
)
def test_environment_failures_are_typed_and_leave_nothing(
    work: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    number: int,
    says: str,
) -> None:
    def fail(*args: object) -> None:
        raise OSError(number, os.strerror(number), str(tmp_path / "out.epk"))

    monkeypatch.setattr(where, fail)
    err = _fails(capsys, _patch(work, tmp_path / "out.epk"), EXIT_FAILED)
    assert says in err and "[Errno" not in err
    assert list(tmp_path.iterdir()) == []  # no target, no temporary


def test_non_utf8_input_path_does_not_crash_the_blas_probe(tmp_path: Path) -> None:
    """The probe reads /proc/self/maps, which names every mapped file, in any encoding."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("no /proc")
    name = tmp_path / os.fsdecode(b"old-\xff.epk")
    name.write_bytes(b"\0" * 4096)
    code = (
        "import mmap, sys\n"
        "from edgepack.server.delta.lowrank import blas_single_thread\n"
        "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
        "with blas_single_thread():\n    pass\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, os.fsencode(name)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert mmap  # the subprocess maps the file as diff does


def test_diff_with_non_utf8_paths(work: Path, tmp_path: Path) -> None:
    old = tmp_path / os.fsdecode(b"old-\xff.epk")
    new = tmp_path / os.fsdecode(b"new-\xfe.epk")
    old.write_bytes((work / "old.epk").read_bytes())
    new.write_bytes((work / "new.epk").read_bytes())
    r = subprocess.run(
        [sys.executable, "-m", "edgepack.cli", "diff", old, new, "-o", tmp_path / "d.epkd"],
        capture_output=True,
    )
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------ item 9: run / compare misuse


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["-p", ""], "the prompt is empty"),
        (["-p", "hi", "--temperature", "-1"], "temperature"),
        (["-p", "hi", "--top-p", "0"], "top-p"),
        (["-p", "hi " * 200], "exceeds the model's 64"),
    ],
)
def test_run_misuse_is_a_usage_error(
    work: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    err = _fails(capsys, ["run", str(work / "l2.epk"), "--max-tokens", "1", *extra], EXIT_USAGE)
    assert says in err


def test_run_verify_none_with_a_trusted_key_is_a_usage_error(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["run", str(work / "l2.epk"), "-p", "hi", "--verify", "none"]
    err = _fails(capsys, [*args, "--trusted-key", str(work / "rel.pub")], EXIT_USAGE)
    assert "nothing would check" in err


@pytest.mark.parametrize(
    ("content", "says"), [(b"", "no tokens"), (b"\xff\xfe\x00binary\x80", "not UTF-8")]
)
def test_compare_bad_text_is_a_usage_error(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, says: str
) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(content)
    args = ["compare", str(work / "l2.epk"), str(work / "l2.epk"), "--text", str(text)]
    assert says in _fails(capsys, args, EXIT_USAGE)


def test_compare_different_layer_counts_is_a_usage_error(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world")
    args = ["compare", str(work / "l2.epk"), str(work / "l3.epk"), "--text", str(text)]
    assert "numbers of layers (2 and 3)" in _fails(capsys, args, EXIT_USAGE)


# --------------------------------------------------------------------------- item 10


def test_unknown_required_feature_exits_incompatible(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build_package(tmp_path / "p.epk", key=None)
    raw = (tmp_path / "p.epk").read_bytes()
    with Package.open(tmp_path / "p.epk") as pkg:
        header = replace(pkg.header, required_features=("sparse-blocks",))
    (tmp_path / "f.epk").write_bytes(replace_header(raw, header))
    err = _fails(capsys, ["verify", str(tmp_path / "f.epk")], EXIT_INCOMPATIBLE)
    assert "sparse-blocks" in err and "update" in err


def _json_error(capsys: pytest.CaptureFixture[str], args: list[str], code: int) -> dict:
    capsys.readouterr()
    assert main(args) == code
    out = capsys.readouterr().out
    error = json.loads(out)["error"]
    assert error["exit_code"] == code and error["message"] and error["type"]
    return error


@pytest.mark.parametrize(
    ("command", "code", "error_type"),
    [
        (["inspect", "--json", "{bad}"], 3, "CorruptPackageError"),
        (["inspect", "--json", "{missing}"], EXIT_USAGE, "BadParameter"),
        (["eval", "{bad}", "--json"], 3, "CorruptPackageError"),
        (["releases", "--json", "--store", "{store}"], EXIT_USAGE, "InvalidStoreURLError"),
    ],
)
def test_json_commands_print_a_json_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    code: int,
    error_type: str,
) -> None:
    bad = tmp_path / "bad.epk"
    bad.write_bytes(b"not a package at all" * 10)
    where = {"bad": bad, "missing": tmp_path / "missing.epk", "store": tmp_path / "store"}
    args = [a.format(**where) for a in command]
    error = _json_error(capsys, args, code)
    assert error["type"] == error_type


def test_json_success_prints_no_error(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["inspect", "--json", str(work / "old.epk")]) == EXIT_OK
    assert "error" not in json.loads(capsys.readouterr().out)
