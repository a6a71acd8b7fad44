"""A package whose model config or tensor set is wrong is refused at open with a typed
error (corrupt: exit 3; a key or tensor of a newer packager: exit 5), never an
internal error in the first forward pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_fixtures import convert_to, repack, tiny_model_dir

import edgepack.runtime_shim as rt
from edgepack.cli.exit_codes import EXIT_CORRUPT, EXIT_INCOMPATIBLE, EXIT_USAGE, exit_code_for
from edgepack.format import CorruptPackageError, IncompatiblePackageError, Package, PackageWriter
from edgepack.runtime_shim.errors import UnsupportedModelError


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("config-checks")


@pytest.fixture(scope="module")
def good(root: Path) -> Path:
    return convert_to(root, tiny_model_dir(root), "f32")


def _rope(kind: str = "linear", **kw: Any) -> dict[str, Any]:
    return {"rope_type": kind, **kw}


CORRUPT_CONFIGS = {
    "eps-string": {"rms_norm_eps": "abc"},
    "eps-negative": {"rms_norm_eps": -1},
    "theta-zero": {"rope_theta": 0},
    "theta-list": {"rope_theta": [1]},
    "factor-zero": {"rope_scaling": _rope(factor=0)},
    "factor-string": {"rope_scaling": _rope(factor="x")},
    "layers-huge": {"num_hidden_layers": 10**9},
    "layers-more-than-stored": {"num_hidden_layers": 31},
    "heads-bool": {"num_attention_heads": True},
    "window-negative": {"sliding_window": -4},
    "layer-types-short": {"layer_types": ["full_attention"]},
    "bias-without-tensor": {"mlp_bias": True},
}


@pytest.mark.parametrize("case", list(CORRUPT_CONFIGS))
def test_bad_config_is_corrupt_at_open(root: Path, good: Path, case: str) -> None:
    pkg = repack(good, root / f"{case}.epk", **CORRUPT_CONFIGS[case])
    with pytest.raises(CorruptPackageError) as info:
        rt.open(pkg, kernels="numpy")
    assert exit_code_for(info.value) == EXIT_CORRUPT
    assert "\n" not in str(info.value)


def test_missing_tensor_is_corrupt_at_open(root: Path, good: Path) -> None:
    pkg = repack(good, root / "no-up.epk", drop=("layers.1.ffn_up.weight", "norm.weight"))
    with pytest.raises(CorruptPackageError, match=r"layers\.1\.ffn_up\.weight"):
        rt.open(pkg, kernels="numpy")


def test_unknown_config_key_needs_a_newer_runtime(root: Path, good: Path) -> None:
    pkg = repack(good, root / "newer-key.epk", rope_pre_scale=50.0)
    with pytest.raises(IncompatiblePackageError, match="rope_pre_scale") as info:
        rt.open(pkg, kernels="numpy")
    assert exit_code_for(info.value) == EXIT_INCOMPATIBLE


def test_unread_tensor_is_refused(root: Path, good: Path) -> None:
    """A tensor the decoder would not read (an o_proj bias under its source name, as
    older packagers stored it) must not be ignored silently."""
    with Package.open(good) as pkg:
        cfg = pkg.header.identity.config
        identity = pkg.header.identity
        out = root / "stray.epk"
        with PackageWriter(out, identity, required_operators=pkg.header.required_operators) as w:
            for t in pkg.header.tensors:
                w.add_tensor(t.name, t.encoding, pkg.dequantize(t.name))
            stray = np.zeros(cfg["hidden_size"], np.float32)
            name = "model.layers.0.self_attn.o_proj.bias"
            w.add_tensor(name, pkg.header.tensors[0].encoding, stray)
            w.finish()
    with pytest.raises(IncompatiblePackageError, match=r"o_proj\.bias"):
        rt.open(out, kernels="numpy")


@pytest.mark.parametrize(
    "config",
    [
        {"rope_scaling": _rope("longrope", factor=4.0)},
        {"hidden_act": "gelu_10"},
        {"family": "bert"},
    ],
)
def test_unsupported_value_in_a_package_is_refused_at_open(
    root: Path, good: Path, config: dict[str, Any]
) -> None:
    key = next(iter(config))
    pkg = repack(good, root / f"unsupported-{key}.epk", **config)
    with pytest.raises(UnsupportedModelError) as info:
        rt.open(pkg, kernels="numpy")
    assert info.value.key == key and "update" not in str(info.value)
    assert exit_code_for(info.value) == EXIT_USAGE


def test_cli_refuses_an_unsupported_model_in_one_line(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`edgepack convert` of a model no version runs: exit 2, one line naming the key."""
    from edgepack.cli import main

    src = tiny_model_dir(root, rope_scaling={"rope_type": "longrope", "factor": 2.0})
    out = root / "longrope.epk"
    capsys.readouterr()
    assert main(["convert", str(src), "-o", str(out), "--encoding", "f32"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rope_scaling" in err and "not supported" in err, err
    assert not out.exists()


def test_cli_run_on_a_bad_config_is_corrupt(
    root: Path, good: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgepack.cli import main

    pkg = repack(good, root / "cli-eps.epk", rms_norm_eps="abc")
    capsys.readouterr()
    assert main(["run", str(pkg), "-p", "hi", "--verify", "none"]) == EXIT_CORRUPT
    err = capsys.readouterr().err
    assert "rms_norm_eps" in err and "internal error" not in err, err
