"""The Python API an app developer meets (issue 16): typed packages, errors catchable
from runtime_shim, SamplingParams accepted where sampling is asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

import edgepack.runtime_shim as rt
from edgepack.format import errors as format_errors

ROOT = Path(__file__).resolve().parents[2]


PACKAGES = ["format", "packager", "runtime_shim", "server", "native", "cli"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_marked_typed(package: str) -> None:
    assert (ROOT / package / "py.typed").is_file()


@pytest.mark.parametrize(
    "name", ["EdgepackError", "CorruptPackageError", "SignatureError", "IncompatiblePackageError"]
)
def test_open_errors_are_reexported(name: str) -> None:
    assert getattr(rt, name) is getattr(format_errors, name) and name in rt.__all__


def test_generate_takes_sampling_params(tmp_path_factory: pytest.TempPathFactory) -> None:
    """(chat() forwards its keyword arguments to generate().)"""
    from runtime_fixtures import tiny_package

    params = rt.SamplingParams(temperature=0.8, top_k=5, seed=3)
    with rt.open(tiny_package(tmp_path_factory, "f32")) as model:
        s = model.session()
        by_params = list(s.generate([1, 5, 7], max_tokens=6, sampling=params))
        by_args = list(s.generate([1, 5, 7], max_tokens=6, temperature=0.8, top_k=5, seed=3))
        assert by_params == by_args
        with pytest.raises(ValueError, match="not both"):
            list(s.generate([1, 5], max_tokens=2, temperature=0.5, sampling=params))
