"""Issue 16: every command of the group takes ``--json`` and ``-q``; under ``--json`` a
success prints one JSON document on stdout and nothing else, a failure the error object
with the README's exit code. The cases are tables over the walked group, so a command
added without a case fails here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
from adapterfactory import write_peft
from serveproc import ServeProcess

from edgepack.cli import main
from edgepack.cli.app import make_cli
from edgepack.cli.exit_codes import EXIT_CORRUPT, EXIT_FAILED, EXIT_USAGE
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)


def _leaves(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    found = []
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            found += _leaves(cmd, f"{prefix}{name} ")
        else:
            found.append((f"{prefix}{name}", cmd))
    return found


COMMANDS = [name for name, _ in _leaves(make_cli())]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GGUF, two packages of it, a key, a delta, a store with one release."""
    d = tmp_path_factory.mktemp("jsonall")
    spec = TinyLlamaSpec(num_hidden_layers=1, max_position_embeddings=64)
    write_gguf_llama(d / "m.gguf", spec, tiny_llama_weights(spec))
    (d / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 8)
    (d / "corrupt.epk").write_bytes(b"EPK1 not a package" * 8)
    steps = [
        ["keygen", str(d / "k")],
        ["convert", str(d / "m.gguf"), "-o", str(d / "a.epk"), "--sign-key", str(d / "k.key")],
        ["convert", str(d / "m.gguf"), "-o", str(d / "b.epk"), "--encoding", "int8",
         "--model-version", "1.1.0"],
        ["diff", str(d / "a.epk"), str(d / "b.epk"), "-o", str(d / "d.epkd")],
        ["repo", "init", "--store", str(d / "st"), "--keys-dir", str(d / "keys")],
        ["publish", str(d / "a.epk"), "--store", str(d / "st"), "--keys-dir", str(d / "keys"),
         "--channel", "beta", "--model", "tiny"],
    ]
    for args in steps:
        assert main([*args, "-q"]) == 0, args
    return d


@pytest.fixture(scope="module")
def server(work: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    proc = ServeProcess(work / "st", tmp_path_factory.mktemp("log") / "serve.log",
                        "--refresh-seconds", "0.2")
    yield f"http://127.0.0.1:{proc.port}"
    proc.stop()


def _store(w: Path) -> list[str]:
    return ["--store", str(w / "st"), "--keys-dir", str(w / "keys")]


def _tuf(w: Path, url: str, tmp: Path) -> list[str]:
    (tmp / "root.json").write_bytes((w / "st" / "metadata" / "1.root.json").read_bytes())
    return ["tuf-client", "--metadata-dir", str(tmp / "meta"), "--metadata-url",
            f"{url}/metadata", "--target-base-url", f"{url}/targets",
            "--target-dir", str(tmp / "t"), "--target-name", "tiny/beta/tiny-1.0.0.epk"]


def _peft(w: Path, tmp: Path) -> str:
    return str(write_peft(tmp / "peft", TinyLlamaSpec(num_hidden_layers=1)))


def _update(w: Path, url: str, tmp: Path) -> list[str]:
    return ["update", "--server", url, "--slot-dir", str(tmp / "slots"), "--device-id", "d1",
            "--channel", "beta", "--model", "tiny",
            "--trusted-root", str(w / "st" / "metadata" / "1.root.json")]


# command -> args of a cheap success, from (work dir, server URL or None, fresh tmp dir)
SUCCESS: dict[str, Any] = {
    "keygen": lambda w, u, t: ["keygen", str(t / "k")],
    "convert": lambda w, u, t: ["convert", str(w / "m.gguf"), "-o", str(t / "x.epk")],
    "inspect": lambda w, u, t: ["inspect", str(w / "a.epk")],
    "verify": lambda w, u, t: ["verify", str(w / "a.epk"), "--trusted-key", str(w / "k.pub")],
    "fetch-sample": lambda w, u, t: ["fetch-sample", "minilm", "--cache", str(t)],
    "build": lambda w, u, t: ["build", str(w / "m.gguf"), "-o", str(t / "x.epk"),
                              "--calib", str(w / "text.txt"), "--no-report"],
    "eval": lambda w, u, t: ["eval", str(w / "b.epk"), "--ref", str(w / "a.epk"),
                             "--text", str(w / "text.txt"), "--ctx", "16", "--chunks", "1"],
    "profile-device": lambda w, u, t: ["profile-device", "-o", str(t / "lut.json"),
                                       "--model", str(w / "a.epk"), "--repeats", "1"],
    "run": lambda w, u, t: ["run", str(w / "a.epk"), "-p", "the", "--max-tokens", "2"],
    "compare": lambda w, u, t: ["compare", str(w / "a.epk"), str(w / "b.epk"),
                                "--text", str(w / "text.txt"), "--max-tokens", "16"],
    "diff": lambda w, u, t: ["diff", str(w / "a.epk"), str(w / "b.epk"), "-o", str(t / "d")],
    "patch": lambda w, u, t: ["patch", str(w / "a.epk"), str(w / "d.epkd"), "-o", str(t / "p")],
    "repo init": lambda w, u, t: ["repo", "init", "--store", str(t / "s"),
                                  "--keys-dir", str(t / "k")],
    "repo rotate-key": lambda w, u, t: ["repo", "rotate-key", "timestamp", *_store(w)],
    "repo renew-root": lambda w, u, t: ["repo", "renew-root", *_store(w)],
    "repo refresh": lambda w, u, t: ["repo", "refresh", *_store(w)],
    "repo verify": lambda w, u, t: ["repo", "verify", *_store(w)],
    "repo gc": lambda w, u, t: ["repo", "gc", "--store", str(w / "st")],
    "publish": lambda w, u, t: ["publish", str(w / "b.epk"), *_store(w), "--channel", "alpha",
                                "--model", "tiny"],
    "promote": lambda w, u, t: ["promote", "1.0.0", "--channel", "stable", "--model", "tiny",
                                *_store(w)],
    "releases": lambda w, u, t: ["releases", "--store", str(w / "st")],
    "serve": lambda w, u, t: ["serve", "--store", str(w / "st")],
    "resign": lambda w, u, t: ["resign", str(w / "a.epk"), "-o", str(t / "r.epk"),
                               "--sign-key", str(w / "k.key"), "--model-version", "1.0.1"],
    "pack-adapter": lambda w, u, t: ["pack-adapter", str(w / "a.epk"), _peft(w, t), "-o",
                                     str(t / "ad.epk")],
    "merge-lora": lambda w, u, t: ["merge-lora", str(w / "a.epk"), _peft(w, t), "-o",
                                   str(t / "m.epk")],
    "update": _update,
    "export": lambda w, u, t: ["export", str(w / "a.epk"), "-o", str(t / "x.gguf")],
    "bench": lambda w, u, t: ["bench", str(w / "a.epk"), "-p", "8", "-n", "2", "-r", "1"],
    "tuf-client init": lambda w, u, t: [*_tuf(w, u, t), "init", str(t / "root.json")],
    "tuf-client refresh": lambda w, u, t: [*_tuf(w, u, t), "refresh"],
    "tuf-client download": lambda w, u, t: [*_tuf(w, u, t), "download"],
}
NEEDS_SERVER = {"update", "tuf-client refresh", "tuf-client download"}

# command -> (args of a failure, its exit code)
FAILURE: dict[str, Any] = {
    "keygen": (lambda w, t: ["keygen", str(w / "k")], EXIT_USAGE),  # exists
    "convert": (lambda w, t: ["convert", str(w / "nope.gguf"), "-o", str(t / "x")], EXIT_USAGE),
    "inspect": (lambda w, t: ["inspect", str(w / "corrupt.epk")], EXIT_CORRUPT),
    "verify": (lambda w, t: ["verify", str(w / "corrupt.epk")], EXIT_CORRUPT),
    "fetch-sample": (lambda w, t: ["fetch-sample", "nope"], EXIT_USAGE),
    "build": (lambda w, t: ["build", str(w / "corrupt.epk"), "-o", str(t / "x.epk")],
              EXIT_CORRUPT),
    "eval": (lambda w, t: ["eval", str(w / "corrupt.epk")], EXIT_CORRUPT),
    "profile-device": (lambda w, t: ["profile-device", "-o", str(t / "l.json"), "--model",
                                     str(w / "corrupt.epk")], EXIT_CORRUPT),
    "run": (lambda w, t: ["run", str(w / "corrupt.epk"), "-p", "x"], EXIT_CORRUPT),
    "compare": (lambda w, t: ["compare", str(w / "corrupt.epk"), str(w / "a.epk"),
                              "--text", str(w / "text.txt")], EXIT_CORRUPT),
    "diff": (lambda w, t: ["diff", str(w / "corrupt.epk"), str(w / "a.epk"), "-o",
                           str(t / "d")], EXIT_CORRUPT),
    "patch": (lambda w, t: ["patch", str(w / "a.epk"), str(w / "corrupt.epk"), "-o",
                            str(t / "p")], EXIT_CORRUPT),
    "repo init": (lambda w, t: ["repo", "init", *_store(w)], EXIT_USAGE),  # already there
    "repo rotate-key": (lambda w, t: ["repo", "rotate-key", "admin", *_store(w)], EXIT_USAGE),
    "repo renew-root": (lambda w, t: ["repo", "renew-root", "--store", str(t / "none"),
                                      "--keys-dir", str(t / "k")], EXIT_USAGE),
    "repo refresh": (lambda w, t: ["repo", "refresh", "--store", str(t / "none"),
                                   "--keys-dir", str(t / "k")], EXIT_USAGE),
    "repo verify": (lambda w, t: ["repo", "verify", "--store", str(t / "none")], EXIT_USAGE),
    "repo gc": (lambda w, t: ["repo", "gc", "--store", str(t / "none")], EXIT_USAGE),
    "publish": (lambda w, t: ["publish", str(w / "corrupt.epk"), *_store(w), "--channel", "x"],
                EXIT_CORRUPT),
    "promote": (lambda w, t: ["promote", "9.9.9", "--channel", "beta", *_store(w)],
                EXIT_USAGE),
    "releases": (lambda w, t: ["releases", "--store", str(t / "none")], EXIT_USAGE),
    "serve": (lambda w, t: ["serve", "--store", str(w / "st"), "--port", "0"], EXIT_USAGE),
    "resign": (lambda w, t: ["resign", str(w / "corrupt.epk"), "-o", str(t / "r"),
                             "--sign-key", str(w / "k.key")], EXIT_CORRUPT),
    "pack-adapter": (lambda w, t: ["pack-adapter", str(w / "corrupt.epk"), _peft(w, t), "-o",
                                   str(t / "ad.epk")], EXIT_CORRUPT),
    "merge-lora": (lambda w, t: ["merge-lora", str(w / "a.epk"), str(w / "b.epk"), "-o",
                                 str(t / "m.epk")], EXIT_USAGE),  # b.epk holds no adapter
    "update": (lambda w, t: ["update", "--server", "http://127.0.0.1:9", "--slot-dir",  # no
                             str(t / "s"), "--device-id", "d", "--channel", "beta",  # --model
                             "--trusted-root", str(w / "st" / "metadata" / "1.root.json")],
               EXIT_FAILED),
    "export": (lambda w, t: ["export", str(w / "b.epk"), "-o", str(t / "x.gguf")],  # int8
               EXIT_USAGE),
    "bench": (lambda w, t: ["bench", str(w / "corrupt.epk")], EXIT_CORRUPT),
    "tuf-client init": (lambda w, t: ["tuf-client", "init", str(w / "a.epk")], EXIT_USAGE),
    "tuf-client refresh": (lambda w, t: ["tuf-client", "--metadata-dir", str(t / "m"),
                                         "--metadata-url", "http://127.0.0.1:9/", "refresh"],
                           EXIT_FAILED),
    "tuf-client download": (lambda w, t: ["tuf-client", "download"], EXIT_USAGE),
}


def test_every_command_has_json_and_quiet() -> None:
    for name, cmd in _leaves(make_cli()):
        opts = {o for p in cmd.params for o in getattr(p, "opts", ())}
        assert {"--json", "-q", "--quiet"} <= opts, name


def test_every_command_has_a_success_and_a_failure_case() -> None:
    assert set(SUCCESS) == set(COMMANDS)
    assert set(FAILURE) == set(COMMANDS)


def _strict(text: str) -> Any:
    """``text`` parsed as strict JSON (no bare NaN / Infinity)."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _invoke(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture()
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """fetch-sample and serve in-process without a download or a listening server."""
    from edgepack.packager import sample_models
    from edgepack.server.http import runner

    monkeypatch.setattr(sample_models, "fetch_minilm", lambda cache: tmp_path / "minilm")
    monkeypatch.setattr(runner, "run", lambda config, **kw: kw)


@pytest.mark.parametrize("command", COMMANDS)
def test_success_prints_one_json_document(
    command: str, work: Path, request: pytest.FixtureRequest, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], no_network: None,
) -> None:
    url = request.getfixturevalue("server") if command in NEEDS_SERVER else None
    args = SUCCESS[command](work, url, tmp_path)
    if command in ("tuf-client refresh", "tuf-client download"):  # trust the root first
        assert main([*args[:-1], "init", str(tmp_path / "root.json")]) == 0
    code, out, err = _invoke(capsys, [*args, "--json"])
    assert code == 0, err
    if command == "serve":  # a server prints nothing on stdout; its logs are on stderr
        assert out == ""
        return
    document = _strict(out)  # the whole of stdout: one document, nothing else
    assert isinstance(document, dict) and document.get("error") is None


QUIET_CASES = [  # command, what its progress shows on stderr without -q
    ("keygen", None),
    ("convert", "converting"),
    ("verify", "verifying"),
    ("eval", "PPL"),
    ("repo verify", None),
    ("releases", None),
]


@pytest.mark.parametrize(("command", "progress"), QUIET_CASES)
def test_quiet_success_prints_nothing_on_stdout_and_no_progress(
    command: str, progress: str | None, work: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = SUCCESS[command](work, None, tmp_path)
    if progress:  # the check can fail: without -q the progress is there
        assert _invoke(capsys, args)[2].count(progress), command
        (tmp_path / "again").mkdir()
        args = SUCCESS[command](work, None, tmp_path / "again")
    code, out, err = _invoke(capsys, [*args, "-q"])
    assert code == 0, err
    assert out == ""
    assert not progress or progress not in err


def test_quiet_run_prints_only_the_text(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _invoke(capsys, [*SUCCESS["run"](work, None, tmp_path), "-q"])
    assert code == 0, err
    assert out.strip() and "tok/s" not in out + err


def test_json_run_has_the_text_and_the_stats(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _invoke(capsys, [*SUCCESS["run"](work, None, tmp_path), "--json"])
    assert code == 0, err
    document = json.loads(out)
    assert document["stats"]["generated_tokens"] == 2
    assert isinstance(document["text"], str)


def test_json_results_carry_the_facts(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _invoke(capsys, [*SUCCESS["convert"](work, None, tmp_path), "--json"])
    result = json.loads(out)["result"]
    assert code == 0 and result["size"] == (tmp_path / "x.epk").stat().st_size
    code, out, _ = _invoke(capsys, [*SUCCESS["verify"](work, None, tmp_path), "--json"])
    assert json.loads(out)["result"]["trusted_signers"], out
    code, out, _ = _invoke(capsys, [*SUCCESS["compare"](work, None, tmp_path), "--json"])
    rows = _strict(out)["result"]["rows"]
    assert code == 0 and {"name", "cosine", "snr_db"} <= set(rows[0])


@pytest.mark.parametrize("command", COMMANDS)
def test_failure_prints_the_json_error(
    command: str, work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_args, expected = FAILURE[command]
    code, out, err = _invoke(capsys, [*make_args(work, tmp_path), "--json"])
    assert code == expected, (out, err)
    error = _strict(out)["error"]
    assert error["exit_code"] == expected
    assert error["type"] and error["message"]
    assert "Traceback" not in err


def test_failing_by_exit_code_still_prints_the_error_object(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`repo verify` reports problems by its exit code, not an exception."""
    import shutil

    shutil.copytree(work / "st", tmp_path / "st")
    payloads = [p for p in (tmp_path / "st").rglob("*") if p.is_file() and p.suffix == ".epk"]
    payloads += [p for p in (tmp_path / "st" / "objects").rglob("*") if p.is_file()]
    assert payloads
    for p in payloads:
        p.unlink()
    code, out, _ = _invoke(capsys, ["repo", "verify", "--store", str(tmp_path / "st"), "--json"])
    document = _strict(out)
    assert code == EXIT_CORRUPT == document["error"]["exit_code"]
    assert document["error"]["type"] == "RepositoryProblems"
    assert document["result"]["problems"]
