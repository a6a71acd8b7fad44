"""The issue's bars on the real model: SmolLM2-135M converted, verified, tampered with."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgepack.format import Encoding, Package, QuantizedTensor, SectionKind
from edgepack.packager.importers import open_source

pytestmark = pytest.mark.slow


def edgepack(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgepack.cli", *args], capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def packaged(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("smollm2")
    assert edgepack("keygen", str(d / "release")).returncode == 0
    assert edgepack("keygen", str(d / "stranger")).returncode == 0
    out = d / "smollm2-int4.epk"
    r = edgepack(
        "convert",
        str(smollm2_gguf),
        "-o",
        str(out),
        "--encoding",
        "int4-g32",
        "--sign-key",
        str(d / "release.key"),
    )
    assert r.returncode == 0, r.stderr
    return {"dir": d, "pkg": out, "pub": d / "release.pub", "stranger": d / "stranger.pub"}


def test_verify_exits_0(packaged: dict[str, Path]) -> None:
    r = edgepack("verify", str(packaged["pkg"]), "--trusted-key", str(packaged["pub"]))
    assert r.returncode == 0, r.stderr


def test_one_flipped_byte_in_any_tensor_is_corrupt(packaged: dict[str, Path]) -> None:
    with Package.open(packaged["pkg"]) as pkg:
        entries = list(pkg.header.tensors)
    rng = random.Random(7)
    bad = packaged["dir"] / "flipped.epk"
    original = packaged["pkg"].read_bytes()
    for entry in rng.sample(entries, 3):
        span = rng.choice([s for s in entry.spans if s.length])
        data = bytearray(original)
        data[span.offset + rng.randrange(span.length)] ^= 1 << rng.randrange(8)
        bad.write_bytes(bytes(data))
        r = edgepack("verify", str(bad), "--trusted-key", str(packaged["pub"]))
        assert r.returncode == 3, (entry.name, r.stderr)
        assert entry.name in r.stderr


def test_signed_by_another_key_exits_4(packaged: dict[str, Path]) -> None:
    r = edgepack("verify", str(packaged["pkg"]), "--trusted-key", str(packaged["stranger"]))
    assert r.returncode == 4


def test_package_content_matches_source(packaged: dict[str, Path], smollm2_gguf: Path) -> None:
    source = open_source(smollm2_gguf)
    with Package.open(packaged["pkg"]) as pkg:
        assert pkg.header.identity.config["num_hidden_layers"] == 30
        assert pkg.section(SectionKind.TOKENIZER) is not None
        q = pkg.tensor("layers.3.attn_q.weight")
        assert isinstance(q, QuantizedTensor) and q.encoding == Encoding.INT4_GROUP_SYM
        w = source.tensor("layers.3.attn_q.weight").load()
        err = np.abs(q.dequantize() - w)
        # int4 RTN: at most half a step, or one step where +8 steps was clipped to +7
        step = np.abs(q.scales.astype(np.float32)).repeat(32, axis=1).reshape(w.shape)
        assert (err <= step + 1e-6).all()
        assert np.mean(err <= step * 0.5 + 1e-6) > 0.99
        emb = pkg.tensor("embed.weight")
        assert emb.encoding == Encoding.INT8_CHANNEL
        assert np.shares_memory(emb.codes, np.frombuffer(pkg._mm, np.uint8))
