"""`edgepack pack-adapter`, `merge-lora`, `build --adapter` and `inspect`'s adapter list,
on a tiny GGUF Llama and a PEFT-layout adapter folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from adapterfactory import write_peft

import edgepack.runtime_shim as rt
from edgepack.cli import main
from edgepack.format import Package
from edgepack.packager.importers.synthetic import (
    TinyLlamaSpec,
    tiny_llama_weights,
    write_gguf_llama,
)

SPEC = TinyLlamaSpec(hidden_size=64, intermediate_size=128, vocab_size=288)
IDS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapter-cli")
    gguf = root / "tiny.gguf"
    write_gguf_llama(gguf, SPEC, tiny_llama_weights(SPEC))
    base = root / "base.epk"
    assert main(["convert", str(gguf), "-o", str(base), "--encoding", "int8"]) == 0
    return {"root": root, "gguf": gguf, "base": base, "peft": write_peft(root / "peft", SPEC)}


def _inspect_json(path: Path, capsys) -> dict:
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_pack_inspect_merge(files, capsys, tmp_path):
    base, peft = files["base"], files["peft"]
    apkg = tmp_path / "a.epk"
    assert main(["pack-adapter", str(base), str(peft), "-o", str(apkg)]) == 0
    assert apkg.stat().st_size < base.stat().st_size / 4
    doc = _inspect_json(apkg, capsys)
    (info,) = doc["adapters"]
    assert info["base_weights_digest"] == Package.open(base).weights_digest.hex()
    assert info["rank"] == 4 and info["encodings"] == ["int8"] and info["bytes"] > 0
    assert "layers.1.attn_v.weight" in info["targets"] and not info["binds_this_package"]
    assert doc["tensors"] == []
    assert main(["inspect", str(apkg)]) == 0
    assert "rank 4" in capsys.readouterr().out

    merged = tmp_path / "m.epk"
    assert main(["merge-lora", str(base), str(apkg), "-o", str(merged)]) == 0
    assert "4 tensors merged into the dequantized base" in capsys.readouterr().out
    with Package.open(merged) as m, Package.open(base) as b:
        assert [t.encoding for t in m.header.tensors] == [t.encoding for t in b.header.tensors]
        pairs = zip(m.header.tensors, b.header.tensors, strict=True)
        changed = [t.name for t, u in pairs if t.hash != u.hash]
        assert sorted(changed) == sorted(info["targets"])
    with rt.open(base, verify="none", kv="float", activations="float") as m:
        online = m.session(adapter=m.load_adapter(apkg)).logits(IDS)
        plain = m.logits(IDS)
    with rt.open(merged, verify="none", kv="float", activations="float") as m:
        offline = m.logits(IDS)
    # re-quantizing the merged weights to int8 costs what int8 costs; the adapter dominates
    assert np.abs(online - offline).max() < 0.25 * np.abs(online - plain).max()


def test_merge_into_source_floats(files, capsys, tmp_path):
    out = tmp_path / "m.epk"
    args = ["merge-lora", str(files["base"]), str(files["peft"]), "-o", str(out)]
    assert main([*args, "--source", str(files["gguf"]), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["result"]
    assert result["from_source"] is True and len(result["merged"]) == 4


def test_wrong_base_is_a_usage_error(files, capsys, tmp_path):
    apkg = tmp_path / "a.epk"
    assert main(["pack-adapter", str(files["base"]), str(files["peft"]), "-o", str(apkg)]) == 0
    other = tmp_path / "f32.epk"
    assert main(["convert", str(files["gguf"]), "-o", str(other)]) == 0
    capsys.readouterr()
    assert main(["merge-lora", str(other), str(apkg), "-o", str(tmp_path / "x.epk")]) == 2
    assert "was made for weights" in capsys.readouterr().err


def test_peft_for_another_model_is_refused(files, capsys, tmp_path):
    wide = write_peft(tmp_path / "wide", TinyLlamaSpec(hidden_size=96, vocab_size=288))
    out = tmp_path / "a.epk"
    assert main(["pack-adapter", str(files["base"]), str(wide), "-o", str(out)]) == 2
    assert "in the base" in capsys.readouterr().err and not out.exists()


def test_build_packs_adapters(files, capsys, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[quantize]\nencodings = ["int8"]\n[calibration]\nsamples = 8\nmax_tokens = 32\n'
    )
    out = tmp_path / "built.epk"
    args = ["build", str(files["gguf"]), "-o", str(out), "--recipe", str(recipe), "--no-report"]
    assert main([*args, "--adapter", str(files["peft"])]) == 0
    (info,) = _inspect_json(out, capsys)["adapters"]
    assert info["binds_this_package"] and info["name"] == "peft"
    with rt.open(out, verify="none") as m:
        handle = m.load_adapter()
        assert m.session(adapter=handle).logits(IDS).shape == (len(IDS), SPEC.vocab_size)


def test_adapter_release_records_its_binding(files, tmp_path):
    from edgepack.server.releases.model import ReleaseInfo
    from edgepack.server.releases.repository import inspect_package

    apkg = tmp_path / "a.epk"
    args = ["pack-adapter", str(files["base"]), str(files["peft"]), "-o", str(apkg)]
    assert main([*args, "--model-version", "1.0.1"]) == 0
    base, adapter = inspect_package(files["base"]), inspect_package(apkg)
    assert adapter.version == "1.0.1" and base.adapter_for == ()
    assert base.weights_digest == Package.open(files["base"]).weights_digest.hex()
    assert adapter.adapter_for == (base.weights_digest,) and adapter.weights_digest == ""
    info = ReleaseInfo(
        "m/beta/a.epk", "m", "1.0.1", "beta", 10_000, adapter.sha256, adapter.length,
        adapter.requirements, adapter_for=adapter.adapter_for,
    )
    back = ReleaseInfo.from_target(info.path, info.length, {"sha256": info.sha256}, info.custom())
    assert back == info and back.is_adapter


def test_published_adapter_release_is_planned_for_its_base(files, tmp_path):
    from edgepack.format.constants import ADAPTER_PLAN_OPERATOR
    from edgepack.runtime_shim.capabilities import runtime_capabilities
    from edgepack.server.http.planner import plan_update
    from edgepack.server.http.schemas import UpdateCheck
    from edgepack.server.releases.repository import ReleaseRepository
    from edgepack.server.store import open_store

    st, keys = ["--store", str(tmp_path / "st")], ["--keys-dir", str(tmp_path / "keys")]
    apkg = tmp_path / "a.epk"
    pack = ["pack-adapter", str(files["base"]), str(files["peft"]), "-o", str(apkg)]
    steps = [
        ["repo", "init", *st, *keys],
        ["publish", str(files["base"]), *st, *keys, "--channel", "beta", "--model", "tiny"],
        [*pack, "--model-version", "1.0.1"],
        ["publish", str(apkg), *st, *keys, "--channel", "beta", "--model", "tiny"],
    ]
    for args in steps:
        assert main([*args, "-q"]) == 0, args
    index = ReleaseRepository(open_store(str(tmp_path / "st"))).index()
    caps = runtime_capabilities()
    base_sha = next(r.sha256 for r in index.releases("tiny", "beta") if not r.is_adapter)
    check = {
        "device_id": "d1", "runtime_version": caps.runtime_version, "channel": "beta",
        "model": "tiny", "free_bytes": 10**9,
        "operators": {**caps.operators, ADAPTER_PLAN_OPERATOR: 1},  # a client installing them
        "operator_set_version": max(caps.operator_set_versions), "installed_sha256": base_sha,
    }  # fmt: skip
    plan = plan_update(index, UpdateCheck.model_validate(check))
    assert plan.plan == "adapter" and plan.bytes == apkg.stat().st_size
    assert plan.targets[0].kind == "adapter" and plan.targets[0].path.endswith("1.0.1.epk")
