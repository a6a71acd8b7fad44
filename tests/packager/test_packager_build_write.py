"""The build checks its exact file size before writing, writes once, keeps its float
reference in memory when it fits and never overwrites its source."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from runtime_fixtures import convert_to, tiny_spec

import edgepack.packager.build.pipeline as pipeline
import edgepack.packager.build.source as source
from edgepack.format import Package
from edgepack.packager.build import BuildOutputError, build
from edgepack.packager.importers.synthetic import tiny_llama_weights, write_gguf_llama
from edgepack.packager.recipe import parse_recipe

SPEC = tiny_spec(hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
KEY = Ed25519PrivateKey.from_private_bytes(bytes([7]) * 32)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = tiny_llama_weights(SPEC)
    w.pop("lm_head.weight", None)
    path = tmp_path_factory.mktemp("build-write") / "tiny.gguf"
    write_gguf_llama(path, SPEC, w)
    return path


def _recipe(target_size: int, **extra) -> dict:
    return {
        "quantize": {"encodings": ["int4", "int3", "int2-asym", "int8"], "group_sizes": [32]},
        "calibration": {"samples": 16, "min_tokens": 8, "max_tokens": 48},
        "search": {"target_size": target_size},
        **extra,
    }


def _count_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = pipeline.write_package

    def counting(*args, **kwargs) -> int:
        sizes.append(real(*args, **kwargs))
        return sizes[-1]

    monkeypatch.setattr(pipeline, "write_package", counting)
    return sizes


@pytest.mark.parametrize(
    ("target", "extra", "keys"),
    [
        (90_000, {}, [KEY]),
        (60_000, {}, []),
        (80_000, {"factorize": {"enabled": True}}, [KEY]),
        (
            75_000,
            {"quantize": {"encodings": ["int4-s8", "int3-s8", "int8"], "group_sizes": [32]}},
            [],
        ),
    ],
)
def test_a_missed_size_target_is_found_before_writing(
    gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    target: int,
    extra: dict,
    keys: list,
) -> None:
    """Estimated overhead 0: the first plan's laid-out file overshoots the target, the
    budget is tightened, and the package is written once, at the size laid out."""
    searches: list[int] = []
    real_search = pipeline.search

    def counting_search(sens, budget, *args):
        searches.append(budget)
        return real_search(sens, budget, *args)

    monkeypatch.setattr(pipeline, "fixed_overhead", lambda *a: 0)
    monkeypatch.setattr(pipeline, "search", counting_search)
    writes = _count_writes(monkeypatch)
    out = tmp_path / "out.epk"
    r = build(gguf, out, parse_recipe(_recipe(target, **extra)), sign_keys=keys, report=False)
    assert len(searches) >= 2 and searches[1] < searches[0]  # the target was missed once
    assert writes == [out.stat().st_size] == [r.nbytes] and r.nbytes <= target
    with Package.open(out) as pkg:
        pkg.verify([KEY.public_key()] if keys else None)
        assert pkg.preamble.signed == bool(keys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.epk"]  # no temporary left


def test_float_reference_in_memory_unless_it_does_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if source.float_dir(1, tmp_path) != Path("/dev/shm"):
        pytest.skip("no writable /dev/shm on this machine")
    monkeypatch.setattr(source, "_available_memory", lambda: 10 * 2**20)
    assert source.float_dir(4 * 2**20, tmp_path) == Path("/dev/shm")
    assert source.float_dir(6 * 2**20, tmp_path) == tmp_path  # twice over: no room


def test_build_never_overwrites_its_source(gguf: Path, tmp_path: Path) -> None:
    f32 = convert_to(tmp_path, gguf, "f32", name="tiny-f32.epk")
    before = f32.read_bytes()
    with pytest.raises(BuildOutputError, match="is the source"):
        build(f32, tmp_path / "." / "tiny-f32.epk", parse_recipe(_recipe(100_000)))
    assert f32.read_bytes() == before
