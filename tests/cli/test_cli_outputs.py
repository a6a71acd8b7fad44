"""Nothing overwritten (issue 11 item 12): an output that is an input (any spelling),
that exists without --force, or that is not a regular file is refused before any work,
exit 2, and the file it names is left byte for byte."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from deltafactory import write_release_pair
from pkgfactory import build_package

from edgepack.cli import main
from edgepack.cli.exit_codes import EXIT_OK, EXIT_USAGE


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("outputs")
    write_release_pair(d, seed=5)
    return d


def _refused(capsys: pytest.CaptureFixture[str], args: list[str], protected: Path) -> str:
    before = protected.read_bytes() if protected.is_file() else None
    capsys.readouterr()
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    if before is not None:
        assert protected.read_bytes() == before
    return err


def test_diff_output_onto_its_input_is_refused(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = work / "old.epk"
    spelled = work / "." / "old.epk"
    for out in (old, spelled):
        err = _refused(capsys, ["diff", str(old), str(work / "new.epk"), "-o", str(out)], old)
        assert "is the input" in err
    # --force never allows replacing an input
    err = _refused(
        capsys, ["diff", str(old), str(work / "new.epk"), "-o", str(spelled), "--force"], old
    )
    assert "is the input" in err


def test_input_behind_a_hard_link_is_still_an_input(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    link = work / "link.epk"
    os.link(work / "old.epk", link)
    try:
        args = ["patch", str(work / "old.epk"), str(work / "d.epkd"), "-o", str(link), "--force"]
        assert "is the input" in _refused(capsys, args, link)
    finally:
        link.unlink()


def test_patch_refuses_an_existing_file_unless_forced(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = work / "precious.epk"
    out.write_bytes(b"keep me")
    args = ["patch", str(work / "old.epk"), str(work / "d.epkd"), "-o", str(out)]
    assert "--force" in _refused(capsys, args, out)
    assert out.read_bytes() == b"keep me"
    assert main([*args, "--force"]) == EXIT_OK
    assert out.read_bytes() == (work / "new.epk").read_bytes()


def test_patch_refuses_a_device_even_forced(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    device = Path("/dev/full")
    if not device.exists():
        pytest.skip("no /dev/full")
    mode = device.stat().st_mode
    args = ["patch", str(work / "old.epk"), str(work / "d.epkd"), "-o", str(device), "--force"]
    assert "not a regular file" in _refused(capsys, args, device)
    assert device.stat().st_mode == mode  # still the device node


def test_convert_onto_its_source_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgepack.packager.importers.synthetic import (
        TinyLlamaSpec,
        tiny_llama_weights,
        write_gguf_llama,
    )

    spec = TinyLlamaSpec(hidden_size=64, intermediate_size=128, vocab_size=288)
    gguf = tmp_path / "tiny.gguf"
    write_gguf_llama(gguf, spec, tiny_llama_weights(spec))
    err = _refused(capsys, ["convert", str(gguf), "-o", str(gguf), "--force"], gguf)
    assert "is the input" in err


def test_output_in_a_missing_or_non_directory_parent(
    work: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    for out, says in ((a_file / "out.epk", "is not a directory"), (tmp_path / "no/out.epk", "")):
        args = ["patch", str(work / "old.epk"), str(work / "d.epkd"), "-o", str(out)]
        assert says in _refused(capsys, args, a_file)


def test_the_api_refuses_to_write_over_an_input(tmp_path: Path) -> None:
    from edgepack.format.delta import apply_delta
    from edgepack.format.errors import OutputPathError

    build_package(tmp_path / "p.epk")
    before = (tmp_path / "p.epk").read_bytes()
    with pytest.raises(OutputPathError, match="is the input"):
        apply_delta(tmp_path / "p.epk", tmp_path / "p.epk", tmp_path / "p.epk")
    assert (tmp_path / "p.epk").read_bytes() == before


def test_keygen_checks_its_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    assert "is not a directory" in _refused(capsys, ["keygen", str(a_file / "rel")], a_file)
    assert main(["keygen", str(tmp_path / "rel")]) == EXIT_OK
    key = tmp_path / "rel.key"
    assert "refusing to overwrite" in _refused(capsys, ["keygen", str(tmp_path / "rel")], key)
