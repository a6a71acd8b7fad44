"""The packager reaches the runtime only through public names (issue 10, part 2).

Every ``from edgepack.runtime_shim... import X`` (and ``import edgepack.runtime_shim.x``)
in the packager must name something in ``edgepack.runtime_shim.__all__``, or in the
``__all__`` of a public submodule (``instrument``); the seam's own behaviour is checked
against the runtime it wraps.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import numpy as np
import pytest
from runtime_fixtures import tiny_package

import edgepack.runtime_shim as rt
from edgepack.runtime_shim import instrument

PACKAGER = Path(__file__).resolve().parents[2] / "packager"
# instrument: the packager's seam; config_table: the one table of config keys, which the
# packager applies at convert/build and the runtime at open
PUBLIC_SUBMODULES = {"edgepack.runtime_shim.instrument", "edgepack.runtime_shim.config_table"}


def _runtime_imports(root: Path) -> list[tuple[str, int, str, str | None]]:
    """(file, line, module, name) of every import of edgepack.runtime_shim* under root."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith("edgepack.runtime_shim"):
                    for alias in node.names:
                        found.append((path.name, node.lineno, node.module, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("edgepack.runtime_shim"):
                        found.append((path.name, node.lineno, alias.name, None))
    return found


def _internal_imports(root: Path) -> list[str]:
    imports = _runtime_imports(root)
    assert imports, "the walk found no runtime import at all: it is broken"
    bad = []
    for file, line, module, name in imports:
        if module == "edgepack.runtime_shim":
            ok = name is None or name in rt.__all__ or f"{module}.{name}" in PUBLIC_SUBMODULES
        elif module in PUBLIC_SUBMODULES:
            ok = name is None or name in importlib.import_module(module).__all__
        else:
            ok = False
        if not ok:
            bad.append(f"{file}:{line}: {module} import {name}")
    return bad


def test_packager_imports_only_public_runtime_names() -> None:
    bad = _internal_imports(PACKAGER)
    assert not bad, "packager imports runtime internals:\n" + "\n".join(bad)


def test_the_walk_catches_an_internal_import(tmp_path: Path) -> None:
    (tmp_path / "leak.py").write_text(
        "from edgepack.runtime_shim import open, Model\n"
        "def f():\n"
        "    from edgepack.runtime_shim.kernels import NumpyKernels\n"
        "    import edgepack.runtime_shim.weights\n"
        "    from edgepack.runtime_shim.instrument import WeightOverrides, _ObservedKernels\n"
    )
    assert _internal_imports(tmp_path) == [
        "leak.py:3: edgepack.runtime_shim.kernels import NumpyKernels",
        "leak.py:4: edgepack.runtime_shim.weights import None",
        "leak.py:5: edgepack.runtime_shim.instrument import _ObservedKernels",
    ]


def test_instrument_all_resolves() -> None:
    for name in instrument.__all__:
        assert getattr(instrument, name) is not None, name


@pytest.fixture(scope="module")
def f32_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_package(tmp_path_factory, "f32")


def test_observe_matmuls_sees_every_input_and_restores(f32_pkg: Path) -> None:
    ids = [3, 1, 4, 1, 5]
    with instrument.open_float_reference(f32_pkg) as m:
        ref = m.logits(ids)
        saved = m.kernels
        seen: list[tuple[str, tuple[int, ...]]] = []
        with instrument.observe_matmuls(m, lambda n, x: seen.append((n, x.shape)), threads=1):
            got = m.session().logits(ids)
        assert m.kernels is saved
    np.testing.assert_array_equal(got, ref)  # observing changes nothing
    names = [n for n, _ in seen]
    assert names[0] == "layers.0.attn_q.weight" and names[-1] == m.weights.output.name
    assert all(shape[0] == len(ids) for _, shape in seen)


def test_weight_overrides_swap_and_reset(f32_pkg: Path) -> None:
    ids = [2, 7, 1, 8]
    with instrument.open_float_reference(f32_pkg) as m:
        ref = m.logits(ids)
        ov = instrument.WeightOverrides(m)
        q = m.weights.layers[0].q
        zero = np.zeros((q.rows, q.cols), np.float32)
        ov.set_linear(q.name, instrument.make_linear(q.name, q.encoding, (q.rows, q.cols), zero))
        ov.set_vector("norm.weight", np.full(m.weights.norm.shape, 2.0, np.float32))
        changed = m.session().logits(ids)
        ov.reset()
        back = m.session().logits(ids)
    assert not np.array_equal(changed, ref)
    np.testing.assert_array_equal(back, ref)
