"""The `edgepack` command end to end on a tiny model: convert, inspect, verify, and the
documented exit codes for corrupt (3), untrusted (4) and incompatible (5) packages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tinymodel import write_tiny_llama

from edgepack.format import Encoding, Package


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgepack.cli", *args], capture_output=True, text=True, cwd=cwd
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    write_tiny_llama(d / "model")
    assert run("keygen", str(d / "release")).returncode == 0
    assert run("keygen", str(d / "other")).returncode == 0
    return d


@pytest.fixture(scope="module")
def signed_int4(workdir: Path) -> Path:
    out = workdir / "tiny-int4.epk"
    r = run(
        "convert",
        str(workdir / "model"),
        "-o",
        str(out),
        "--encoding",
        "int4-g32",
        "--sign-key",
        str(workdir / "release.key"),
    )
    assert r.returncode == 0, r.stderr
    return out


def test_keygen_refuses_to_overwrite(workdir: Path) -> None:
    r = run("keygen", str(workdir / "release"))
    assert r.returncode == 2
    assert "already exists" in r.stderr
    assert "Traceback" not in r.stderr


def test_verify_ok(signed_int4: Path, workdir: Path) -> None:
    r = run("verify", str(signed_int4), "--trusted-key", str(workdir / "release.pub"))
    assert r.returncode == 0, r.stderr
    assert "signed by trusted key" in r.stdout


def test_int4_plan_keeps_norms_float_and_embeddings_int8(signed_int4: Path) -> None:
    with Package.open(signed_int4) as pkg:
        enc = {t.name: t.encoding for t in pkg.header.tensors}
    assert enc["norm.weight"] == Encoding.F32
    assert enc["layers.0.attn_norm.weight"] == Encoding.F32
    assert enc["embed.weight"] == Encoding.INT8_CHANNEL
    assert enc["output.weight"] == Encoding.INT8_CHANNEL
    assert enc["layers.1.ffn_down.weight"] == Encoding.INT4_GROUP_SYM


def test_lossless_f32_roundtrip(workdir: Path) -> None:
    from tinymodel import tiny_llama_tensors

    out = workdir / "tiny-f32.epk"
    assert run("convert", str(workdir / "model"), "-o", str(out)).returncode == 0
    src = tiny_llama_tensors()
    with Package.open(out) as pkg:
        np.testing.assert_array_equal(
            pkg.tensor("layers.0.ffn_up.weight"), src["model.layers.0.mlp.up_proj.weight"]
        )
        np.testing.assert_array_equal(pkg.tensor("embed.weight"), src["model.embed_tokens.weight"])


def test_flipped_tensor_byte_is_corrupt(signed_int4: Path, workdir: Path) -> None:
    with Package.open(signed_int4) as pkg:
        entry = pkg.entry("layers.0.attn_q.weight")
    bad = workdir / "flipped.epk"
    data = bytearray(signed_int4.read_bytes())
    data[entry.codes.offset + 7] ^= 0x10
    bad.write_bytes(bytes(data))
    r = run("verify", str(bad), "--trusted-key", str(workdir / "release.pub"))
    assert r.returncode == 3, r.stderr
    assert "layers.0.attn_q.weight" in r.stderr
    assert "Traceback" not in r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [
        "error: tensor 'layers.0.attn_q.weight' hash mismatch: its data is corrupt"
    ]


def test_other_key_is_signature_error(signed_int4: Path, workdir: Path) -> None:
    r = run("verify", str(signed_int4), "--trusted-key", str(workdir / "other.pub"))
    assert r.returncode == 4
    assert "not by a trusted key" in r.stderr


def test_newer_min_runtime_is_incompatible(workdir: Path) -> None:
    out = workdir / "future.epk"
    r = run("convert", str(workdir / "model"), "-o", str(out), "--min-runtime-version", "99.0.0")
    assert r.returncode == 0, r.stderr
    r = run("verify", str(out))
    assert r.returncode == 5
    assert "99.0.0" in r.stderr and "update the app" in r.stderr


def test_usage_errors_exit_2(workdir: Path) -> None:
    r = run("convert", str(workdir / "model"), "-o", str(workdir / "x.epk"), "--encoding", "int5")
    assert r.returncode == 2
    assert "unknown encoding" in r.stderr
    assert not (workdir / "x.epk").exists()
    assert run("verify").returncode == 2


def test_not_a_package_is_corrupt(workdir: Path) -> None:
    junk = workdir / "junk.epk"
    junk.write_bytes(b"hello world" * 100)
    r = run("verify", str(junk))
    assert r.returncode == 3
    assert "not an edgepack package" in r.stderr


def test_inspect_json(signed_int4: Path) -> None:
    r = run("inspect", str(signed_int4), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["signed"] is True
    assert doc["identity"]["architecture"] == "llama"
    assert {s["kind"] for s in doc["sections"]} >= {"precision_plan"}
    assert len(doc["tensors"]) == 2 * 9 + 3
    r = run("inspect", str(signed_int4))
    assert "int4-g32 " in r.stdout and "bits/weight" in r.stdout
    assert "int4_group_sym/" not in r.stdout  # the CLI's labels, not the enum's names
    cfg = doc["identity"]["config"]
    assert (
        f"{cfg['num_hidden_layers']} layers, width {cfg['hidden_size']}, "
        f"heads {cfg['num_attention_heads']} (kv {cfg['num_key_value_heads']}), "
        f"context {cfg['max_position_embeddings']:,}, vocabulary {cfg['vocab_size']:,}"
    ) in r.stdout
    from edgepack.format import key_id, load_public_key

    signer = key_id(load_public_key(signed_int4.parent / "release.pub"))
    signer = signer.hex() if isinstance(signer, bytes) else signer
    assert doc["signature_key_ids"] == [signer]
    assert f"signed by key id {signer[:16]}" in r.stdout
