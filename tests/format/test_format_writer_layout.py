"""The size laid out from metadata (PackageSizer) is the size written (PackageWriter), and
the writer puts spans in place: hinted or not, the bytes are the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgepack.format import Encoding, ModelIdentity, Package, PackageWriter, SectionKind
from edgepack.format.layout import tensor_layout
from edgepack.format.preamble import Preamble
from edgepack.format.writer import PackageSizer

IDENTITY = ModelIdentity("m", "1.0.0", "llama", {"hidden_size": 64})
KEYS = [Ed25519PrivateKey.from_private_bytes(bytes([i]) * 32) for i in (1, 2)]


def _parts(encoding: Encoding, shape: tuple[int, ...], group: int, rng) -> list:
    layout = tensor_layout(encoding, shape, group)
    return [
        None
        if p is None
        else rng.integers(0, 256, p.nbytes, dtype=np.uint8).view(p.dtype).reshape(p.shape)
        for p in (layout.codes, layout.scales, layout.zeros)
    ]


def _plan(kind: str) -> list[tuple]:
    """(name, encoding, shape, group) rows, a ("low_rank", ...) row, sections."""
    rows: list[tuple] = [("norm.weight", Encoding.F32, (64,), 0)]
    if kind == "mixed":  # every encoding, a page-aligned one, a low-rank pair
        for e in Encoding:
            if e != Encoding.LOW_RANK:
                rows.append((f"w.{e.name.lower()}", e, (16, 64), 32 if e.is_group else 0))
        rows.append(("big.weight", Encoding.INT8_CHANNEL, (256, 512), 0))
        rows.append(("lr.u", Encoding.INT8_CHANNEL, (64, 8), 0))
        rows.append(("lr.v", Encoding.INT4_GROUP_SYM, (8, 64), 32))
        rows.append(("low_rank", "lr.weight", (64, 64), ("lr.u", "lr.v"), 8))
    elif kind == "s8":
        for e in Encoding:
            if e.scale_bits == 8:
                rows.append((f"w.{e.name.lower()}", e, (32, 128), 32))
    elif kind == "wide-header":  # a header over one page: the data region starts later
        for i in range(120):
            rows.append((f"layers.{i}.attn_q.weight", Encoding.INT4_GROUP_ASYM, (8, 64), 32))
    return rows


SECTIONS = [
    (SectionKind.TOKENIZER, b'{"vocab": ' + b'"ab" ' * 3000 + b"}", "tokenizer.json"),
    (SectionKind.CHAT_TEMPLATE, b"{{ x }}", "default"),
    (SectionKind.PRECISION_PLAN, bytes(np.random.default_rng(3).integers(0, 256, 5000)), "p"),
]


def _emit(w, rows: list[tuple], rng, *, declare: bool) -> None:
    for row in rows:
        if row[0] == "low_rank":
            _, name, shape, factors, rank = row
            w.add_low_rank(name, shape, factors, rank)
        elif declare:
            w.declare_tensor(*row)
        else:
            name, enc, shape, group = row
            w.add_tensor(name, enc, *_parts(enc, shape, group, rng), shape=shape, group_size=group)
    for kind, data, name in SECTIONS:
        w.add_section(kind, data, name=name)


@pytest.mark.parametrize("kind", ["mixed", "s8", "wide-header"])
@pytest.mark.parametrize("nkeys", [0, 1, 2])
def test_laid_out_size_is_written_size(tmp_path: Path, kind: str, nkeys: int) -> None:
    rows, keys = _plan(kind), KEYS[:nkeys]
    sized = {}
    for declare in (True, False):  # metadata only, and with the arrays
        s = PackageSizer(IDENTITY, required_operators=[("arch.llama", 1)])
        _emit(s, rows, np.random.default_rng(0), declare=declare)
        sized[declare] = (s.file_size(keys), s.data_offset)
    assert sized[True] == sized[False]
    size, data_offset = sized[True]
    files = {}
    for hint in (data_offset, None):  # in place from the start, and moved at finish
        out = tmp_path / f"{kind}-{hint}.epk"
        with PackageWriter(
            out, IDENTITY, required_operators=[("arch.llama", 1)], data_offset=hint
        ) as w:
            _emit(w, rows, np.random.default_rng(0), declare=False)
            w.finish(keys)
        files[hint] = out.read_bytes()
        assert len(files[hint]) == size
        assert Preamble.unpack(files[hint][:128], size).data_offset == data_offset
        with Package.open(out) as pkg:
            pkg.verify([k.public_key() for k in keys] if keys else None)
    assert files[data_offset] == files[None]
    assert (data_offset == 4096) == (kind == "s8")  # both of the writer's paths are taken
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{kind}-{h}.epk" for h in (data_offset, None)
    )  # no spool, no partial file left


def test_wrong_hint_still_writes_the_same_bytes(tmp_path: Path) -> None:
    rows = _plan("mixed")
    outs = []
    for hint in (4096, 8 * 4096):  # the data moves forward, then back (exact: 8192)
        out = tmp_path / f"h{hint}.epk"
        with PackageWriter(out, IDENTITY, data_offset=hint) as w:
            _emit(w, rows, np.random.default_rng(1), declare=False)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="page aligned"):
        PackageWriter(tmp_path / "x.epk", IDENTITY, data_offset=100)


def test_sizer_refuses_what_the_writer_refuses(tmp_path: Path) -> None:
    s = PackageSizer(IDENTITY)
    s.declare_tensor("a", Encoding.F32, (4,))
    with pytest.raises(ValueError, match="twice"):
        s.declare_tensor("a", Encoding.F32, (4,))
    with pytest.raises(ValueError, match="group size"):
        s.declare_tensor("b", Encoding.INT4_GROUP_SYM, (4, 64), 3)
    with PackageWriter(tmp_path / "w.epk", IDENTITY) as w:
        with pytest.raises(ValueError, match="only sizes"):
            w.declare_tensor("a", Encoding.F32, (4,))
        w.abort()
    assert not list(tmp_path.iterdir())
