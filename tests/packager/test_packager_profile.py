"""profile-device: the latency table, its fits and its use as a latency budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgepack.packager.encode import parse_encoding
from edgepack.packager.errors import LatencyTableError
from edgepack.packager.profile_device import LatencyTable, predict_package_ms, profile


def test_profile_small_grid_round_trip(tmp_path: Path) -> None:
    table = profile(
        encodings=("int8", "int4-g32", "int3-g32"),
        shapes=[(64, 64), (128, 64), (64, 128)],
        kernels="numpy",
        threads=1,
        repeats=2,
    )
    assert len(table.entries) == 9
    assert all(v > 0 for v in table.entries.values())
    assert set(table.fits) == {"int8", "int4-g32", "int3-g32"}
    path = tmp_path / "lut.json"
    table.save(path)
    back = LatencyTable.load(path)
    assert back.entries == table.entries and back.kernels == "numpy"
    # measured shapes are looked up, others come from the fit
    assert back.matmul_ms(64, 64, "int8") == table.entries["64x64 int8"]
    assert back.matmul_ms(256, 256, "int4-g32") > 0
    assert back.predict((64, 128), parse_encoding("int3-g32")) == table.entries["64x128 int3-g32"]
    with pytest.raises(LatencyTableError, match="no timings for int2-g32"):
        back.matmul_ms(64, 64, "int2-g32")
    # 8-bit group scales run the twin's kernels: its timings stand in unless profiled
    s8 = parse_encoding("int3-g32-s8")
    assert back.predict((64, 128), s8) == table.entries["64x128 int3-g32"]
    with pytest.raises(LatencyTableError, match="no timings for int2-g32"):
        back.matmul_ms(64, 64, "int2-g32-s8")


def test_bad_table(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text('{"format": "other"}')
    with pytest.raises(LatencyTableError, match="not an edgepack latency table"):
        LatencyTable.load(p)


def test_profile_with_model_measures_overhead(tmp_path: Path) -> None:
    from runtime_fixtures import convert_to, tiny_model_dir

    pkg = convert_to(tmp_path, tiny_model_dir(tmp_path), "int4-g32")
    table = profile(model=pkg, encodings=("int8", "int4-g32"), kernels="numpy", repeats=1)
    assert len(table.overhead) == 1
    assert predict_package_ms(table, pkg) > 0


def test_profile_with_a_float_model_times_its_own_encoding(tmp_path: Path) -> None:
    """The measured decode step is predicted from the model's encodings, so those are
    profiled even when not asked for (an f32 model used to end in a KeyError)."""
    from runtime_fixtures import convert_to, tiny_model_dir

    pkg = convert_to(tmp_path, tiny_model_dir(tmp_path), "f32")
    table = profile(model=pkg, encodings=("int8",), kernels="numpy", repeats=1)
    assert "f32" in table.fits and "int8" in table.fits
    assert len(table.overhead) == 1 and predict_package_ms(table, pkg) > 0
