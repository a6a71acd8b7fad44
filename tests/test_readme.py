"""Every ```sh, ```python and ```toml block of README.md runs, in order, so the README
cannot drift from the code.

The blocks share one temporary folder holding what the README assumes exists, made
real and small: ``model.gguf`` and ``finetuned.gguf`` (a tiny Llama GGUF and a nudged
copy), ``calib.txt`` / ``calib.jsonl`` (calibration text) and ``recipe.toml`` (the
README's own recipe block, with a budget a tiny model can meet; the block itself is
parsed as written). Everything else a block uses, an earlier block writes.
An HTML comment on the line before a block says how to run it:

* ``<!-- test: skip (reason) -->``: not run; the reason is required.
* ``<!-- test: slow -->``: marked slow (``make test`` runs it, ``make test-fast`` not).
* ``<!-- test: s3 -->``: against a local S3 server (moto) standing in for
  ``http://minio:9000``, with the bucket of ``s3://BUCKET/...`` created.
* ``<!-- test: serve -->``: each ``edgepack serve`` line starts in the background on a
  free port (standing in for 8080) and the rest of the block runs once it answers.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from s3server import s3_server  # noqa: F401  (the `s3` blocks' server)

README = Path(__file__).resolve().parent.parent / "README.md"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_DIRECTIVE = re.compile(r"<!--\s*test:\s*(.*?)\s*-->\s*\Z")
_KNOWN = {"skip", "slow", "s3", "serve"}
_RUNNABLE = ("sh", "python", "toml")
_TIMEOUT = 900
# A tiny model's fixed bytes (header, tokenizer, norms) and its protected layer 0 are a
# large share of it: the README recipe's bits per weight cannot be met, so it gets more.
_README_BPW = "target_bpw = 4.5"
_TINY_BPW = "target_bpw = 7.0"


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    code: str
    flags: frozenset[str]
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.lang}@{self.line}"


def readme_blocks() -> list[Block]:
    text = README.read_text(encoding="utf-8")
    blocks = []
    for m in _FENCE.finditer(text):
        if m.group(1) not in _RUNNABLE:
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        directive = _DIRECTIVE.search(before)
        words, reason = (directive.group(1) if directive else ""), ""
        if "(" in words:
            words, reason = words.split("(", 1)
            reason = reason.rstrip(")").strip()
        line = text.count("\n", 0, m.start()) + 1
        blocks.append(Block(line, m.group(1), m.group(2), frozenset(words.split()), reason))
    return blocks


BLOCKS = readme_blocks()


def _param(block: Block):
    marks = [pytest.mark.slow] if {"slow", "s3", "serve"} & block.flags else []
    return pytest.param(block, id=block.id, marks=marks)


def test_directives_are_known_and_skips_say_why() -> None:
    assert any(b.lang == "sh" for b in BLOCKS) and any(b.lang == "python" for b in BLOCKS)
    for b in BLOCKS:
        assert b.flags <= _KNOWN, f"README line {b.line}: unknown test directive {b.flags}"
        assert ("skip" not in b.flags) or b.reason, f"README line {b.line}: skip needs a reason"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from runtime_fixtures import calibration_text

    from edgepack.packager.importers.synthetic import (
        TinyLlamaSpec,
        tiny_llama_weights,
        write_gguf_llama,
    )

    d = tmp_path_factory.mktemp("readme")
    # head_dim 32: the native int8 KV cache `run` uses needs V groups of 32
    spec = TinyLlamaSpec(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, vocab_size=288
    )
    weights = tiny_llama_weights(spec)
    write_gguf_llama(d / "model.gguf", spec, weights)
    rng = np.random.default_rng(1)
    noise = {n: (rng.standard_normal(w.shape) * 1e-3).astype(w.dtype) for n, w in weights.items()}
    tuned = {n: w + noise[n] for n, w in weights.items()}
    write_gguf_llama(d / "finetuned.gguf", replace(spec, seed=1), tuned)
    text = calibration_text()
    (d / "calib.txt").write_text(text, encoding="utf-8")
    docs = [p for p in text.split("\n\n") if p.strip()]
    (d / "calib.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    (toml,) = [b.code for b in BLOCKS if b.lang == "toml"]
    assert _README_BPW in toml, "the README recipe's target_bpw changed: update _TINY_BPW"
    (d / "recipe.toml").write_text(toml.replace(_README_BPW, _TINY_BPW), encoding="utf-8")
    return d


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_readme_block(block: Block, workdir: Path, request: pytest.FixtureRequest) -> None:
    if "skip" in block.flags:
        pytest.skip(f"README line {block.line}: {block.reason}")
    if block.lang == "toml":
        import tomllib

        from edgepack.packager.recipe import load_recipe, parse_recipe

        load_recipe(workdir / "recipe.toml")
        parse_recipe(tomllib.loads(block.code))
        return
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    code = block.code
    if "s3" in block.flags:
        server = request.getfixturevalue("s3_server")
        for bucket in set(re.findall(r"s3://([a-z0-9.-]+)", code)):
            server.create_bucket(bucket)
        code = code.replace("http://minio:9000", server.endpoint_url)
        env.update(server.env())
    if block.lang == "python" and "serve" in block.flags:  # beside a server, as sh does
        script = f"edgepack serve --store releases/\n{sys.executable} - <<'PYEOF'\n{code}\nPYEOF"
        cmd = ["bash", "-e", "-o", "pipefail", "-c", _background_servers(script)]
    elif block.lang == "python":
        cmd = [sys.executable, "-c", code]
    else:
        if "serve" in block.flags:
            code = _background_servers(code)
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    r = subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=_TIMEOUT
    )
    assert r.returncode == 0, (
        f"README line {block.line} ({block.lang}) failed with {r.returncode}:\n"
        f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _background_servers(code: str) -> str:
    """Start each `edgepack serve` line in the background on a free port, wait until it
    answers /healthz, and stop it when the block ends."""
    port = _free_port()
    code = code.replace("8080", str(port))
    out = ["pids=()", 'trap \'kill "${pids[@]}" 2>/dev/null; wait\' EXIT']
    for line in code.splitlines():
        if line.startswith("edgepack serve"):
            command = line.split("#", 1)[0].rstrip()
            if "--port" not in command:
                command += f" --port {port}"
            out += [
                f"{command} 2>serve.log & pids+=($!)",
                f"for _ in $(seq 300); do curl -sf localhost:{port}/healthz >/dev/null && break;"
                ' kill -0 "${pids[-1]}" || { cat serve.log; exit 1; }; sleep 0.1; done',
                f"curl -sf localhost:{port}/healthz >/dev/null",
            ]
        else:
            out.append(line)
    return "\n".join(out)


def test_readme_sections_example_names_a_kind(tmp_path: Path) -> None:
    """The README's `pkg.section("tokenizer")` works (issue 16: it raised ValueError), and
    an unknown kind name says which ones exist."""
    from pkgfactory import build_package

    from edgepack.format import Package, SectionKind

    built = build_package(tmp_path / "p.epk")  # with a tokenizer.json section
    with Package.open(built.path) as pkg:
        tokenizer = pkg.section(SectionKind.TOKENIZER)
        assert tokenizer and pkg.section("tokenizer") == tokenizer
        assert pkg.sections("TOKENIZER") == pkg.sections(SectionKind.TOKENIZER)
        with pytest.raises(ValueError, match=r"unknown section kind 'tokeniser'.*tokenizer"):
            pkg.section("tokeniser")
