"""`edgepack build/convert --prefix-file`: caches stored, signed once, listed by inspect;
the cache-only change between two releases is a small delta."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from edgepack.cli import main
from edgepack.format import Package, SectionKind, load_public_key
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)
from edgepack.runtime_shim import open as open_model

SYSTEM = "You are a terse assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prefixcli")
    spec = TinyLlamaSpec(hidden_size=64, intermediate_size=128, vocab_size=288)
    path = root / "tiny.gguf"
    write_gguf_llama(path, spec, tiny_llama_weights(spec))
    return path


def _prefix_file(tmp_path: Path, prompts: list[str]) -> Path:
    p = tmp_path / "prompts.json"
    p.write_text(json.dumps(prompts))
    return p


def test_build_stores_system_prompt_caches_signed_once(
    gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    main(["keygen", str(tmp_path / "k")])
    out = tmp_path / "m.epk"
    args = ["build", str(gguf), "-o", str(out), "--no-report"]
    args += ["--sign-key", str(tmp_path / "k.key")]
    args += ["--prefix-file", str(_prefix_file(tmp_path, [SYSTEM])), "--prefix-system"]
    assert main(args) == 0
    assert "prefix cache prefix-0:" in capsys.readouterr().out
    with Package.open(out) as pkg:
        pkg.verify([load_public_key(tmp_path / "k.pub")])
        assert len(pkg.sections(SectionKind.PREFIX_KV_CACHE)) == 1
    with open_model(out, trusted_keys=[tmp_path / "k.pub"]) as m:
        s = m.session()
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        list(s.chat(msgs, max_tokens=2))
        assert s.stats.cached_prompt_tokens == m.prefix_store.caches[0][1].num_tokens
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "prefix caches 1" in text and "binding ok" in text
    assert main(["inspect", "--json", str(out)]) == 0
    (row,) = json.loads(capsys.readouterr().out)["prefix_caches"]
    assert row["binding"] == "ok" and row["tokens"] > 5 and row["bytes"] > 0
    assert row["in_place"] is (sys.platform in ("linux", "darwin"))  # mapped, not copied


def test_changed_caches_ship_as_a_small_delta(
    gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    v1, v2, delta = tmp_path / "v1.epk", tmp_path / "v2.epk", tmp_path / "d.epkd"
    for out, prompt in ((v1, "Once upon a time"), (v2, "In a galaxy far away, long ago")):
        args = ["convert", str(gguf), "-o", str(out), "--encoding", "int8"]
        assert main([*args, "--prefix-file", str(_prefix_file(tmp_path, [prompt]))]) == 0
    with Package.open(v1) as a, Package.open(v2) as b:
        assert a.weights_digest == b.weights_digest
    capsys.readouterr()
    assert main(["diff", str(v1), str(v2), "-o", str(delta)]) == 0
    assert delta.stat().st_size < v2.stat().st_size // 4


def test_bad_prefix_file_is_a_usage_error(gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('["ok", 3]')
    args = ["convert", str(gguf), "-o", str(tmp_path / "x.epk"), "--prefix-file", str(bad)]
    assert main(args) == 2
    assert main(["convert", str(gguf), "-o", str(tmp_path / "y.epk"), "--prefix-system"]) == 2


def test_build_stores_the_recipe_prefixes(gguf: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[[prefixes]]\nname = "system"\ntext = "{SYSTEM}"\nsystem = true\n')
    out = tmp_path / "m.epk"
    assert main(["build", str(gguf), "-o", str(out), "--no-report", "--recipe", str(recipe)]) == 0
    with open_model(out, verify="none") as m:
        ((_name, cache),) = m.prefix_store.caches
        assert cache.text == SYSTEM
        s = m.session()
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        list(s.chat(msgs, max_tokens=2))
        assert s.stats.cached_prompt_tokens == cache.num_tokens
