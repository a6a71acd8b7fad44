"""The weights digest changes with any stored weight and with nothing else."""

from __future__ import annotations

from dataclasses import replace

from pkgfactory import build_package, make_key, replace_header

from edgepack.format import Package, SectionKind, weights_digest


def _digest(path) -> bytes:
    with Package.open(path) as pkg:
        return pkg.weights_digest


def test_same_weights_same_digest_whatever_the_sections_and_signer(tmp_path):
    a = build_package(tmp_path / "a.epk", seed=3)
    b = build_package(
        tmp_path / "b.epk",
        seed=3,
        key=make_key(9),
        extra_sections=[(int(SectionKind.METADATA_JSON), "extra", b'{"x": 1}', False)],
    )
    assert len(_digest(a.path)) == 32
    assert _digest(a.path) == _digest(b.path)


def test_other_weights_other_digest(tmp_path):
    a = build_package(tmp_path / "a.epk", seed=3)
    b = build_package(tmp_path / "b.epk", seed=4)
    assert _digest(a.path) != _digest(b.path)


def test_each_tensor_record_field_is_covered(tmp_path):
    built = build_package(tmp_path / "a.epk", seed=3)
    with Package.open(built.path) as pkg:
        tensors = list(pkg.header.tensors)
    base = weights_digest(tensors)
    first = tensors[0]
    variants = [
        replace(first, name=first.name + "x"),
        replace(first, hash=bytes(32)),
        replace(first, shape=(*first.shape, 1)),
        replace(first, group_size=first.group_size + 1),
    ]
    for variant in variants:
        assert weights_digest([variant, *tensors[1:]]) != base
    assert weights_digest(reversed(tensors)) == base


def test_digest_survives_a_header_rewrite_that_keeps_tensors(tmp_path):
    built = build_package(tmp_path / "a.epk", seed=3)
    raw = built.path.read_bytes()
    with Package.open(built.path) as pkg:
        header = pkg.header
    moved = tmp_path / "b.epk"
    moved.write_bytes(replace_header(raw, replace(header, sections=header.sections)))
    assert _digest(moved) == _digest(built.path)


def test_copied_tensors_keep_the_digest(tmp_path):
    """``PackageWriter.copy_tensor`` adds a tensor exactly as stored, every encoding."""
    from edgepack.format import PackageWriter

    built = build_package(tmp_path / "a.epk", seed=5)
    with Package.open(built.path) as pkg:
        h = pkg.header
        with PackageWriter(tmp_path / "b.epk", h.identity) as w:
            for t in h.tensors:
                w.copy_tensor(pkg, t.name)
            w.finish()
        encodings = {t.encoding for t in h.tensors}
        original = pkg.weights_digest
    assert len(encodings) >= 6  # the factory's package holds every kind of tensor
    assert _digest(tmp_path / "b.epk") == original
