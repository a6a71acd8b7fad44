"""Delta creation runs in bounded memory (issue 12 item 6): no residual outlives the
planning of its tensor, and every changed tensor's mapped pages are released.

Checked by what is alive, not by RSS or time, so the tests hold on any machine; the
measured numbers are ``bench/delta.py --synthetic-1b``'s.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import pytest
from deltafactory import ModelSpec, TensorSpec, write_spec

from edgepack.format import Encoding
from edgepack.format.delta import apply_delta
from edgepack.server.delta import DeltaOptions, build, create_delta

CHANGED = 6


@pytest.fixture(scope="module")
def lora_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Eight int4 matrices, six of them re-quantized after a rank-4 update."""
    rng = np.random.default_rng(3)
    old_t, new_t = [], []
    for i in range(CHANGED + 2):
        w = (rng.standard_normal((64, 128)) * 0.05).astype(np.float32)
        old_t.append(TensorSpec(f"layers.{i}.w", Encoding.INT4_GROUP_SYM, w))
        if i < CHANGED:
            lora = rng.standard_normal((64, 4)) @ rng.standard_normal((4, 128))
            w = w + (lora * (0.02 * np.linalg.norm(w) / np.linalg.norm(lora))).astype(np.float32)
        new_t.append(TensorSpec(f"layers.{i}.w", Encoding.INT4_GROUP_SYM, w))
    d = tmp_path_factory.mktemp("lora-pair")
    return write_spec(d / "old.epk", ModelSpec(old_t)), write_spec(d / "new.epk", ModelSpec(new_t))


def test_no_residual_outlives_its_tensor(lora_pair, tmp_path: Path, monkeypatch) -> None:
    old, new = lora_pair
    alive: list[weakref.ref] = []
    planned: list[str] = []
    plan_tensor = build._Planner.tensor_choices

    def tracking(self, t):
        held = [r for r in alive if r() is not None]
        assert not held, f"{len(held)} residual(s) of earlier tensors still held at {t.name}"
        out = plan_tensor(self, t)
        for c in out:
            for choice in (c, c.factors_of):
                for array in (choice.residual, choice.aux) if choice is not None else ():
                    if isinstance(array, np.ndarray):
                        alive.append(weakref.ref(array))
        planned.append(t.name)
        return out

    monkeypatch.setattr(build._Planner, "tensor_choices", tracking)
    stats = create_delta(old, new, tmp_path / "d.epkd", options=DeltaOptions(workers=1))
    assert len(planned) == CHANGED + 2
    assert alive, "the changed tensors produced no residual to track"
    assert stats.coded > 0
    assert not [r for r in alive if r() is not None]
    apply_delta(old, tmp_path / "d.epkd", tmp_path / "out.epk")
    assert (tmp_path / "out.epk").read_bytes() == new.read_bytes()


def test_mapped_pages_released_per_tensor(lora_pair, tmp_path: Path, monkeypatch) -> None:
    old, new = lora_pair
    released: list[tuple[str, int]] = []
    release = build._Files.release

    def counting(self, which, spans=()):
        released.append((which, len(spans)))
        return release(self, which, spans)

    monkeypatch.setattr(build._Files, "release", counting)
    create_delta(old, new, tmp_path / "d.epkd", options=DeltaOptions(workers=2))
    per_tensor = [r for r in released if r[1]]
    assert sum(1 for which, _ in per_tensor if which == "new") == CHANGED + 2
    assert sum(1 for which, _ in per_tensor if which == "old") == CHANGED + 2
    assert {("new", 0), ("old", 0)} <= set(released)  # and everything once planned
