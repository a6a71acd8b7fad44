"""Create tensor-aware deltas (spec/DELTA.md): match, choose a coding per part, write.

Matching: a target tensor or section whose content hash exists in the base is copied
(renamed or moved: still free); otherwise the base entry of the same name is its
reference. Unchanged parts of a changed tensor are copied too. Each remaining part
(codes, scales and zeros separately) is coded the cheapest of: plain zstd, zstd with the
old part as dictionary, XOR or element-wise difference against the old part, and - for
quantized targets with a same-shaped base tensor - difference against the base tensor
re-quantized into the target encoding (the codes with the target's own new scales),
optionally corrected by a fitted low-rank update (a FACTORS op: a merged LoRA fine-tune
costs its factors plus a few residual codes, not every code it moved; see lowrank.py).
Candidates are compared with a fast zstd level; the winners' residuals are gathered
into a few streams by kind (so similar residuals share one entropy model) and
compressed at the final level. Padding becomes ZERO ops, and copies that line up merge,
so an unchanged data region is one op.

The result is applied once before it is published (``verify=True``), so a delta that
would not reproduce the target is never written.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
import mmap
import os
import shutil
import tempfile
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zstandard

from edgepack.format import Encoding, Package
from edgepack.format.delta.apply import apply_delta
from edgepack.format.delta.container import (
    PREAMBLE_SIZE,
    PREDICT_FROM,
    PREDICT_TO,
    Codec,
    Combine,
    DeltaHeader,
    DeltaPreamble,
    Op,
    OpKind,
    Part,
    Prediction,
    RefKind,
    Shuffle,
    Stream,
    encode_header,
    header_digest,
    validate,
)
from edgepack.format.delta.predict import (
    BaseRows,
    Factors,
    predict_codes_directed,
    predict_part,
)
from edgepack.format.delta.transforms import planes, residual_of, shuffle, sparsify
from edgepack.format.file_mode import seal_output
from edgepack.format.header import Span, TensorEntry
from edgepack.format.header_decode import offset_vectors
from edgepack.format.layout import tensor_layout
from edgepack.format.output_file import (
    check_output_path,
    create_partial,
    create_scratch_dir,
    remove_stale_partials,
)
from edgepack.format.signing import build_signature_block
from edgepack.server.delta.entropy import rans_encode

from .lowrank import blas_single_thread, cell_bounds, fit_lowrank, quantize_factors

__all__ = ["DeltaOptions", "DeltaStats", "create_delta"]

_HASH_CHUNK = 8 << 20
_MAX_WINDOW_LOG = 27  # the patcher accepts windows up to 2^27 (spec)
_RESIDUAL_WINDOW_LOG = 21
_OWN_STREAM_COST = 48  # bytes: frame header, block headers, Huffman tables, stream record
_RANS_MIN = 1024  # bytes of a stream below which rANS's lane states cost more than it saves
_SPARSE_MAX_DENSITY = 0.25  # non-zero byte share above which a sparse residual never wins
_FACTOR_QMAX = (15, 31)  # precisions tried for FACTORS codes
_ROW_BLOCK_ELEMENTS = 1 << 20  # elements per row block of whole-matrix arithmetic


@dataclass(frozen=True)
class DeltaOptions:
    """Knobs of :func:`create_delta`; the defaults are what the CLI and server use."""

    level: int = 19  # final zstd level of every stream
    probe_level: int = 3  # level used to compare candidate codings of one part
    workers: int = 2  # threads (numpy and zstd release the GIL)
    dict_limit: int = 16 << 20  # largest part tried with its old part as zstd dictionary
    factors_limit: int = 1 << 24  # largest tensor (elements) a low-rank correction is fit to
    verify: bool = True  # apply the delta once before publishing it


@dataclass
class DeltaStats:
    path: Path
    size: int
    ops: int
    streams: int
    copied: int  # target bytes produced by COPY ops
    zero: int  # target bytes produced by ZERO ops
    coded: int  # target bytes produced by DATA ops
    methods: Counter = field(default_factory=Counter)  # method -> parts
    method_bytes: Counter = field(default_factory=Counter)  # method -> compressed bytes (probe)


# ------------------------------------------------------------------------- candidates


@dataclass
class _Choice:
    """One coded target range: an op template plus its residual and stream class."""

    op: Op
    residual: np.ndarray | _Spilled | None  # None for COPY / ZERO
    stream_class: str = ""
    dict_span: tuple[int, int] = (0, 0)
    method: str = ""
    probe_size: int = 0
    factors_of: _Choice | None = None  # the FACTORS choice a predicted op uses
    aux: np.ndarray | _Spilled | None = None  # SPARSE: the non-zero bytes; PLANES: high planes
    aux_class: str = ""


def _elem_width(dtype: np.dtype, encoding: Encoding, part: int) -> int:
    """Element width (bits) for ADD residuals of a part: a predictable target's codes
    are added code by code (int4: nibbles)."""
    if part == Part.CODES and encoding in PREDICT_TO:
        return encoding.bits
    return dtype.itemsize * 8


class _Files:
    """Read-only maps of both files as uint8 arrays.

    Pages read through a map count in the process's resident set until unmapped:
    :meth:`release` drops them (the page cache keeps them) once a tensor is planned, so
    reading two 1 GB packages does not make the creator a 2 GB process.
    """

    def __init__(self, old: Path, new: Path) -> None:
        self._handles = []
        self._maps: dict[str, mmap.mmap] = {}
        self.old = self._map(old, "old")
        self.new = self._map(new, "new")

    def _map(self, path: Path, which: str) -> np.ndarray:
        f = open(path, "rb")
        self._handles.append(f)
        if os.fstat(f.fileno()).st_size == 0:
            return np.empty(0, np.uint8)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._handles.append(mm)
        self._maps[which] = mm
        return np.frombuffer(mm, np.uint8)

    def release(self, which: str, spans: Sequence[Span] = ()) -> None:
        """Drop the resident pages of ``spans`` of file ``which`` (all of it by default);
        a later read faults them back in from the page cache."""
        mm = self._maps.get(which)
        if mm is None:
            return
        ranges = [(s.offset, s.length) for s in spans if s.length] if spans else [(0, len(mm))]
        for offset, length in ranges:
            start = offset - offset % mmap.PAGESIZE
            end = min(len(mm), -(-(offset + length) // mmap.PAGESIZE) * mmap.PAGESIZE)
            if end > start:
                mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        self.old = self.new = None  # type: ignore[assignment]
        for h in reversed(self._handles):
            try:
                h.close()
            except BufferError:  # a view still alive; the GC closes it later
                pass


def _sha256_file(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.digest()


@dataclass(frozen=True)
class _Spilled:
    """Where a residual went in the :class:`_Spool`."""

    offset: int
    length: int


class _Spool:
    """An anonymous temporary file the planned residuals are written to as soon as their
    tensor is planned, and read back one stream at a time when the streams are coded:
    the creator holds one tensor's candidates and one stream, never every residual."""

    def __init__(self, directory: Path) -> None:
        self._file = tempfile.TemporaryFile(dir=directory, prefix=".epkd-spool.")
        self._end = 0
        self._lock = threading.Lock()

    def put(self, data: np.ndarray) -> _Spilled:
        raw = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        with self._lock:
            offset = self._end
            self._end += raw.nbytes
        _pwrite_all(self._file.fileno(), raw, offset)
        return _Spilled(offset, raw.nbytes)

    def gather(self, parts: Sequence[_Spilled]) -> bytearray:
        """The concatenation of ``parts``."""
        out = bytearray(sum(p.length for p in parts))
        view, pos = memoryview(out), 0
        for p in parts:
            _pread_into(self._file.fileno(), view[pos : pos + p.length], p.offset)
            pos += p.length
        return out

    def close(self) -> None:
        self._file.close()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if not n:
            raise OSError(f"delta spool ends at {offset}")
        view, offset = view[n:], offset + n


def _spill(choices: Sequence[_Choice], spool: _Spool) -> None:
    """Move the residuals of ``choices`` (and of the FACTORS they use) to ``spool``."""
    for c in choices:
        for choice in (c, c.factors_of) if c.factors_of is not None else (c,):
            if isinstance(choice.residual, np.ndarray):
                choice.residual = spool.put(choice.residual)
            if isinstance(choice.aux, np.ndarray):
                choice.aux = spool.put(choice.aux)


def _bounded_map(pool: ThreadPoolExecutor, fn: Callable, items: Sequence, ahead: int):
    """``pool.map(fn, items)`` with at most ``ahead`` results running or waiting: the
    plain map submits everything, and results finished out of order pile up."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) > ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


class _Planner:
    def __init__(self, old: Package, new: Package, files: _Files, options: DeltaOptions) -> None:
        self.old, self.new, self.files, self.opt = old, new, files, options
        self._local = threading.local()  # zstd contexts are not thread-safe
        base_tensors = [t for t in old.header.tensors if t.encoding != Encoding.LOW_RANK]
        self.base_by_name = {t.name: t for t in base_tensors}
        self.base_by_hash: dict[bytes, TensorEntry] = {}
        for t in base_tensors:
            self.base_by_hash.setdefault(t.hash, t)
        self.base_sections = {(s.kind, s.name): s for s in old.header.sections}
        self.base_section_hash = {}
        for s in old.header.sections:
            self.base_section_hash.setdefault(s.hash, s)

    # -- helpers ---------------------------------------------------------------
    def old_bytes(self, span: Span | tuple[int, int]) -> np.ndarray:
        off, n = (span.offset, span.length) if isinstance(span, Span) else span
        return self.files.old[off : off + n]

    def new_bytes(self, span: Span | tuple[int, int]) -> np.ndarray:
        off, n = (span.offset, span.length) if isinstance(span, Span) else span
        return self.files.new[off : off + n]

    def _probe(self, data: np.ndarray, dict_data=None) -> int:
        if dict_data is not None:
            c = zstandard.ZstdCompressor(level=self.opt.probe_level, dict_data=dict_data)
            return len(c.compress(data))
        probe = getattr(self._local, "probe", None)
        if probe is None:
            probe = self._local.probe = zstandard.ZstdCompressor(level=self.opt.probe_level)
        return len(probe.compress(data))

    def _best(self, cands: list[_Choice]) -> _Choice:
        for c in cands:
            if c.residual is not None and not c.probe_size:
                if c.dict_span[1]:
                    d = zstandard.ZstdCompressionDict(
                        self.old_bytes(c.dict_span).tobytes(),
                        dict_type=zstandard.DICT_TYPE_RAWCONTENT,
                    )
                    c.probe_size = self._probe(c.residual, d)
                else:
                    c.probe_size = self._probe(c.residual)
                if c.aux is not None:
                    c.probe_size += self._probe(c.aux)
        # a candidate with a stream of its own pays a frame and entropy tables that a
        # shared stream amortizes; ties go to the earlier (cheaper to apply) candidate
        return min(cands, key=lambda c: c.probe_size + (_OWN_STREAM_COST if c.dict_span[1] else 0))

    # -- one target range ------------------------------------------------------------
    def literal_candidates(
        self, span: Span, width: int, klass: str, base_span: Span | None
    ) -> list[_Choice]:
        """Candidates for bytes with an optional same-length-or-not base counterpart."""
        target = self.new_bytes(span)
        elem = width // 8 if width >= 16 else 1
        shuf = 1 if elem > 1 and span.length % elem == 0 else 0
        op = Op(OpKind.DATA, span.offset, span.length, width=width if shuf else 8, shuffle=shuf)
        cands = [
            _Choice(op, shuffle(target, elem) if shuf else target, f"{klass}/lit", method="zstd")
        ]
        if base_span is None or not base_span.length:
            return cands
        if base_span.length == span.length:
            ref = self.old_bytes(base_span)
            base_ref = dict(ref_kind=RefKind.BASE, ref_offset=base_span.offset)
            cands += _data_choices(
                Op(OpKind.DATA, span.offset, span.length, combine=Combine.XOR, **base_ref),
                residual_of(target, ref, Combine.XOR, 8),
                f"{klass}/xor",
                "xor",
            )
            add_ok = width == 4 or span.length % max(1, width // 8) == 0
            if add_ok:
                cands += _data_choices(
                    Op(
                        OpKind.DATA,
                        span.offset,
                        span.length,
                        combine=Combine.ADD,
                        width=width,
                        shuffle=shuf,
                        **base_ref,
                    ),
                    residual_of(target, ref, Combine.ADD, width),
                    f"{klass}/add{width}",
                    f"add{width}",
                )
        if span.length <= self.opt.dict_limit and base_span.length <= self.opt.dict_limit:
            cands.append(
                _Choice(
                    op,
                    shuffle(target, elem) if shuf else target,
                    "",
                    dict_span=(base_span.offset, base_span.length),
                    method="zstd-dict",
                )
            )
        return cands

    def tensor_choices(self, t: TensorEntry) -> list[_Choice]:
        """Ops producing every part of target tensor ``t``."""
        parts = [(k, s) for k, s in enumerate(t.spans) if s.length]
        same = self.base_by_hash.get(t.hash)
        named = self.base_by_name.get(t.name)
        if named is not None and named.hash == t.hash:
            same = named
        if same is not None and [s.length for s in same.spans] == [s.length for s in t.spans]:
            return [
                _Choice(
                    Op(OpKind.COPY, s.offset, s.length, base_offset=same.spans[k].offset),
                    None,
                    method="copy",
                )
                for k, s in parts
            ]
        layout = tensor_layout(t.encoding, t.shape, t.group_size)
        dtypes = (layout.codes, layout.scales, layout.zeros)
        out: list[_Choice] = []
        predictable = (
            named is not None
            and t.encoding in PREDICT_TO
            and named.encoding in PREDICT_FROM
            and len(t.shape) >= 2
            and len(named.shape) >= 2
            and _matrix(t.shape) == _matrix(named.shape)
        )
        w_base = None
        for k, span in parts:
            base_span = named.spans[k] if named is not None else None
            if (
                base_span is not None
                and base_span.length == span.length
                and np.array_equal(self.old_bytes(base_span), self.new_bytes(span))
            ):
                out.append(
                    _Choice(
                        Op(OpKind.COPY, span.offset, span.length, base_offset=base_span.offset),
                        None,
                        method="copy",
                    )
                )
                continue
            width = _elem_width(dtypes[k].dtype, t.encoding, k)
            klass = f"{('codes', 'scales', 'zeros')[k]}{width}"
            cands = self.literal_candidates(span, width, klass, base_span)
            if predictable:
                if w_base is None:
                    w_base = self._dequantized(named)
                cands += self._predicted(t, named, k, span, width, klass, w_base)
            out.append(self._best(cands))
        # a correction can only pay for itself by shrinking the codes' residual: skip the
        # fit when that already costs less than the smallest correction would
        codes_cost = sum(c.probe_size for c in out if c.op.target_offset == t.codes.offset)
        rows, cols = _matrix(t.shape)
        if (
            predictable
            and w_base is not None
            and w_base.size <= self.opt.factors_limit
            and codes_cost > 2 * (rows + cols)
        ):
            corrected = self._with_factors(t, named, w_base)
            if corrected is not None and corrected[0] < _cost(out):
                return corrected[1]
        return out

    def _with_factors(
        self, t: TensorEntry, b: TensorEntry, w: np.ndarray
    ) -> tuple[int, list[_Choice]] | None:
        """``(probe size, choices)`` with every part predicted from the base plus a fitted
        low-rank correction (the FACTORS choice hangs off them), or None."""
        rows, cols = _matrix(t.shape)
        scales = self.new_bytes(t.scales)
        zeros = self.new_bytes(t.zeros) if t.zeros.length else None
        lo, hi = cell_bounds(
            w,
            t.encoding,
            t.group_size,
            self.new_bytes(t.codes),
            scales.view("<f4" if t.encoding == Encoding.INT8_CHANNEL else "<f2"),
            zeros.view("<f2") if zeros is not None else None,
        )
        fit = fit_lowrank(lo, hi)
        del lo, hi
        if fit is None:
            return None
        best = None
        layout = tensor_layout(t.encoding, t.shape, t.group_size)
        dtypes = (layout.codes, layout.scales, layout.zeros)
        for qmax in _FACTOR_QMAX:
            raw = quantize_factors(*fit, qmax)
            rank = fit[0].shape[1]
            factors = Factors(raw, rows, cols, rank)
            corrected = _corrected(w, factors)
            fop = Op(OpKind.FACTORS, 0, 0, rows=rows, cols=cols, rank=rank)
            fchoice = _Choice(fop, np.frombuffer(raw, np.uint8), "factors", method="factors")
            fchoice.probe_size = self._probe(fchoice.residual)
            choices: list[_Choice] = []
            for k, span in enumerate(t.spans):
                if not span.length:
                    continue
                width = _elem_width(dtypes[k].dtype, t.encoding, k)
                klass = f"{('codes', 'scales', 'zeros')[k]}{width}"
                cands = self._predicted(t, b, k, span, width, klass + "f", corrected)
                for c in cands:
                    c.factors_of = fchoice
                    c.method += "+factors"
                choices.append(self._best(cands))
            cost = fchoice.probe_size + _cost(choices)
            if best is None or cost < best[0]:
                best = (cost, choices)
        return best

    def _dequantized(self, b: TensorEntry) -> np.ndarray:
        rows, cols = _matrix(b.shape)
        reader = BaseRows(
            lambda off, n: self.files.old[off : off + n].tobytes(),
            b.encoding,
            cols,
            b.group_size,
            (b.codes.offset, b.scales.offset, b.zeros.offset),
        )
        return reader.dequantize(0, rows)

    def _predicted(
        self,
        t: TensorEntry,
        b: TensorEntry,
        part: int,
        span: Span,
        width: int,
        klass: str,
        w: np.ndarray,
    ) -> list[_Choice]:
        rows, cols = _matrix(t.shape)
        pred = Prediction(
            base_encoding=int(b.encoding),
            rows=rows,
            cols=cols,
            base_group_size=b.group_size,
            base_codes_offset=b.codes.offset,
            base_scales_offset=b.scales.offset,
            base_zeros_offset=b.zeros.offset,
            target_encoding=int(t.encoding),
            target_group_size=t.group_size,
            part=part,
            target_scales_offset=t.scales.offset if part == Part.CODES else 0,
            target_zeros_offset=t.zeros.offset if part == Part.CODES else 0,
        )
        negate = None
        if part == Part.CODES:
            zeros = self.new_bytes(t.zeros).tobytes() if t.zeros.length else None
            ref, negate = predict_codes_directed(
                w, t.encoding, t.group_size, self.new_bytes(t.scales).tobytes(), zeros
            )
        else:
            ref = predict_part(w, t.encoding, t.group_size, part)
        target = self.new_bytes(span)
        shuf = 1 if width >= 16 else 0
        out: list[_Choice] = []
        modes = [(Combine.ADD, "")]
        if negate is not None:  # codes: also with the rounding direction folded in
            modes.append((Combine.ADD_DIRECTED, "-directed"))
        for mode, tag in modes:
            op = Op(
                OpKind.DATA,
                span.offset,
                span.length,
                combine=mode,
                width=width,
                shuffle=shuf,
                ref_kind=RefKind.PREDICTED,
                prediction=pred,
            )
            raw = residual_of(target, ref, mode, width, negate)
            out += _data_choices(op, raw, f"p{klass}{tag}", f"predict-add{width}{tag}")
        return out

    def head_choices(self) -> list[_Choice]:
        """Preamble and header of the target: zstd with the old ones as dictionary.

        A header's vectors of table offsets (tensors, sections) all shift by the same
        amount when anything before them grows; coded as 32-bit differences against the
        old vectors they cost almost nothing, where zstd would pay for every entry.
        """
        pre, old_pre = self.new.preamble, self.old.preamble
        h0, h1 = pre.header_offset, pre.header_offset + pre.header_length
        if pre.data_offset == old_pre.data_offset and np.array_equal(
            self.new_bytes((0, h1)), self.old_bytes((0, h1))
        ):
            return [_Choice(Op(OpKind.COPY, 0, h1, base_offset=0), None, method="copy")]
        head_dict = (0, old_pre.header_offset + old_pre.header_length)
        new_header = self.new_bytes((h0, pre.header_length)).tobytes()
        old_header = self.old_bytes((old_pre.header_offset, old_pre.header_length)).tobytes()
        cuts: list[tuple[int, int, int]] = []  # (target offset, length, base offset)
        old_vectors = offset_vectors(old_header)
        for key, a in offset_vectors(new_header).items():
            b = old_vectors[key]
            if a[1] == b[1] and a[1]:
                cuts.append((h0 + a[0], 4 * a[1], old_pre.header_offset + b[0]))
        cuts.sort()
        out: list[_Choice] = []
        pos = 0

        def literal(start: int, end: int) -> None:
            if end > start:
                op = Op(OpKind.DATA, start, end - start)
                out.append(
                    _Choice(op, self.new_bytes((start, end - start)), "head", head_dict, "header")
                )

        for start, n, base in cuts:
            if start < pos:
                continue
            literal(pos, start)
            res = residual_of(
                self.new_bytes((start, n)), self.old_bytes((base, n)), Combine.ADD, 32
            )
            op = Op(
                OpKind.DATA,
                start,
                n,
                combine=Combine.ADD,
                width=32,
                ref_kind=RefKind.BASE,
                ref_offset=base,
            )
            out.append(_Choice(op, res, "head", head_dict, "header"))
            pos = start + n
        literal(pos, h1)
        return out

    def section_choices(self, sec) -> list[_Choice]:
        span = sec.data
        same = self.base_section_hash.get(sec.hash)
        named = self.base_sections.get((sec.kind, sec.name))
        if named is not None and named.hash == sec.hash:
            same = named
        if same is not None and same.data.length == span.length:
            return [
                _Choice(
                    Op(OpKind.COPY, span.offset, span.length, base_offset=same.data.offset),
                    None,
                    method="copy",
                )
            ]
        base_span = named.data if named is not None else None
        return [self._best(self.literal_candidates(span, 8, "section", base_span))]


def _data_choices(op: Op, raw: np.ndarray, klass: str, method: str) -> list[_Choice]:
    """Codings of one DATA op's residual ``raw`` (spec section 4) for :meth:`_Planner._best`.

    * As it is; a byte-shuffled op (``op.shuffle`` BYTES) is stored as PLANES, its low
      plane and its high planes in streams of their own kind: streams are shared by all
      ops of a class, and mixing the near-uniform low bytes with the near-constant high
      ones in one stream costs zstd's entropy tables more than a per-op probe can see.
    * Sparse when at most a quarter of its bytes are non-zero: a re-quantized fine-tune
      moves a few percent of the codes, and zstd spends several times their entropy on
      the zero runs between them.
    """
    if op.shuffle == Shuffle.BYTES:
        first, rest = planes(raw, op.elem_bytes)
        main = _Choice(
            dataclasses.replace(op, shuffle=Shuffle.PLANES),
            first,
            f"{klass}/planes/0",
            method=f"{method}-planes",
            aux=rest,
            aux_class=f"{klass}/planes/1+",
        )
    else:
        main = _Choice(op, raw, klass, method=method)
    if np.count_nonzero(raw) > raw.size * _SPARSE_MAX_DENSITY:
        return [main]
    positions, values = sparsify(raw)
    sparse = dataclasses.replace(
        op, shuffle=Shuffle.SPARSE, positions_length=positions.size, values_length=values.size
    )
    return [
        main,
        _Choice(
            sparse,
            positions,
            f"{klass}/sparse/positions",
            method=f"{method}-sparse",
            aux=values,
            aux_class=f"{klass}/sparse/values",
        ),
    ]


def _corrected(w: np.ndarray, factors: Factors) -> np.ndarray:
    """``w`` plus the correction (non-finite values zeroed), computed by row blocks as the
    patcher does: the whole product would be a float64 matrix twice ``w``'s size."""
    out = np.empty_like(w)
    rows, cols = w.shape
    step = max(1, _ROW_BLOCK_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        np.add(w[r0:r1], factors.block(r0, r1), out=out[r0:r1])
    out[~np.isfinite(out)] = 0
    return out


def _cost(choices: list[_Choice]) -> int:
    return sum(c.probe_size for c in choices if c.residual is not None)


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


# ------------------------------------------------------------------------- assembly


def _plan(planner: _Planner, options: DeltaOptions, spool: _Spool) -> list[_Choice]:
    """Choices covering the whole target, in target order (gaps filled later); the
    tensors' residuals are in ``spool``."""
    new = planner.new
    pre = new.preamble
    choices: list[_Choice] = planner.head_choices()
    tensors = [t for t in new.header.tensors if t.encoding != Encoding.LOW_RANK]

    def planned(t: TensorEntry) -> list[_Choice]:
        out = planner.tensor_choices(t)
        _spill(out, spool)
        planner.files.release("new", t.spans)
        named = planner.base_by_name.get(t.name)
        if named is not None:
            planner.files.release("old", named.spans)
        return out

    workers = max(1, options.workers)
    with blas_single_thread(), ThreadPoolExecutor(workers) as pool:
        for result in _bounded_map(pool, planned, tensors, workers):
            choices += result
    for sec in new.header.sections:
        if sec.data.length:
            choices += planner.section_choices(sec)
    old_pre = planner.old.preamble
    if pre.signature_length:
        span = Span(pre.signature_offset, pre.signature_length)
        old_sig = Span(old_pre.signature_offset, old_pre.signature_length)
        if old_sig.length == span.length and np.array_equal(
            planner.new_bytes(span), planner.old_bytes(old_sig)
        ):
            choices.append(
                _Choice(
                    Op(OpKind.COPY, span.offset, span.length, base_offset=old_sig.offset),
                    None,
                    method="copy",
                )
            )
        else:
            choices.append(
                _Choice(
                    Op(OpKind.DATA, span.offset, span.length),
                    planner.new_bytes(span),
                    "literal",
                    method="signature",
                )
            )
    choices.sort(key=lambda c: c.op.target_offset)
    return _fill_and_merge(choices, planner)


def _fill_and_merge(choices: list[_Choice], planner: _Planner) -> list[_Choice]:
    size = planner.files.new.size
    filled: list[_Choice] = []
    pos = 0

    def gap(start: int, end: int) -> None:
        data = planner.files.new[start:end]
        if not data.any():
            filled.append(_Choice(Op(OpKind.ZERO, start, end - start), None, method="zero"))
        else:
            filled.append(
                _Choice(Op(OpKind.DATA, start, end - start), data, "literal", method="literal")
            )

    for c in choices:
        if c.op.target_offset > pos:
            gap(pos, c.op.target_offset)
        filled.append(c)
        pos = c.op.target_end
    if pos < size:
        gap(pos, size)

    merged: list[_Choice] = []
    for c in filled:
        prev = merged[-1] if merged else None
        if prev is not None and prev.op.kind == OpKind.ZERO and c.op.kind == OpKind.ZERO:
            merged[-1] = _Choice(
                Op(OpKind.ZERO, prev.op.target_offset, prev.op.length + c.op.length),
                None,
                method="zero",
            )
            continue
        if c.op.kind == OpKind.COPY and prev is not None:
            # COPY [ZERO] COPY with one displacement and zero base bytes in between -> one COPY
            anchor = merged[-2] if prev.op.kind == OpKind.ZERO and len(merged) >= 2 else prev
            if anchor.op.kind == OpKind.COPY:
                shift = anchor.op.base_offset - anchor.op.target_offset
                if c.op.base_offset - c.op.target_offset == shift:
                    lo, hi = anchor.op.target_end + shift, c.op.base_offset
                    if lo >= 0 and not planner.files.old[lo:hi].any():
                        start = anchor.op
                        merged_op = Op(
                            OpKind.COPY,
                            start.target_offset,
                            c.op.target_end - start.target_offset,
                            base_offset=start.base_offset,
                        )
                        if anchor is not prev:
                            merged.pop()
                        merged[-1] = _Choice(merged_op, None, method="copy")
                        continue
        merged.append(c)
    return merged


def _order(choices: list[_Choice]) -> list[_Choice]:
    """Table order: target order, except that a FACTORS op comes right before the first
    op using it and a predicted codes op right after the ops writing its target's scales
    and zeros (it reads them back), so corrections live only while they are needed."""
    targets = [c for c in choices if c.op.kind != OpKind.FACTORS]
    starts = [c.op.target_offset for c in targets]

    def covering(offset: int, length: int) -> list[int]:
        if not length:
            return []
        k = bisect.bisect_right(starts, offset) - 1
        ids = []
        while k < len(targets) and targets[k].op.target_offset < offset + length:
            ids.append(id(targets[k]))
            k += 1
        return ids

    out: list[_Choice] = []
    emitted: set[int] = set()
    pending: list[tuple[_Choice, list[int]]] = []

    def emit(c: _Choice) -> None:
        f = c.factors_of
        if f is not None and id(f) not in emitted:
            out.append(f)
            emitted.add(id(f))
        out.append(c)
        emitted.add(id(c))

    for c in targets:
        p = c.op.prediction
        if p is not None and p.part == Part.CODES:
            scales = (p.target_scales_offset, c.op.length and _part_len(p, Part.SCALES))
            zeros = (p.target_zeros_offset, _part_len(p, Part.ZEROS))
            pending.append((c, covering(*scales) + covering(*zeros)))
        else:
            emit(c)
        ready = [item for item in pending if all(i in emitted for i in item[1])]
        for item in ready:
            pending.remove(item)
            emit(item[0])
    for c, _ in pending:  # unreachable: every dependency is some target range
        emit(c)
    return out


def _part_len(p: Prediction, part: int) -> int:
    from edgepack.format.delta.container import part_length

    return part_length(p.target_encoding, p.rows, p.cols, p.target_group_size, part)


def _compress(
    data: bytes | bytearray, level: int, dict_bytes: bytes | None
) -> tuple[int, bytes | bytearray]:
    if not data:
        return Codec.STORED, b""
    source = len(data) + (len(dict_bytes) if dict_bytes else 0)
    params = zstandard.ZstdCompressionParameters.from_level(
        level, source_size=source, write_content_size=1, write_checksum=0, write_dict_id=0
    )
    # residuals have no long-range redundancy: a small window bounds the patcher's memory
    limit = _MAX_WINDOW_LOG if dict_bytes else _RESIDUAL_WINDOW_LOG
    if params.window_log > limit:
        params = zstandard.ZstdCompressionParameters.from_level(
            level,
            source_size=source,
            window_log=limit,
            write_content_size=1,
            write_checksum=0,
            write_dict_id=0,
        )
    dict_data = None
    if dict_bytes:
        dict_data = zstandard.ZstdCompressionDict(
            dict_bytes, dict_type=zstandard.DICT_TYPE_RAWCONTENT
        )
    packed = zstandard.ZstdCompressor(compression_params=params, dict_data=dict_data).compress(data)
    best = (Codec.ZSTD, packed)
    if not dict_bytes:
        if len(data) >= _RANS_MIN:  # memoryless residuals: order-0 rANS beats Huffman
            coded = rans_encode(np.frombuffer(data, np.uint8))
            if len(coded) < len(packed):
                best = (Codec.RANS, coded)
        if len(best[1]) >= len(data):
            return Codec.STORED, data
    return best


def create_delta(
    old: str | os.PathLike[str],
    new: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    signing_keys: Sequence[object] = (),
    options: DeltaOptions | None = None,
    progress: Callable[[str], None] | None = None,
) -> DeltaStats:
    """Write the delta turning package ``old`` into package ``new`` to ``out``.

    Memory is bounded by one tensor's working set (per worker) and one stream, not by the
    packages: residuals wait in a spool file, coded streams in a payload file next to
    ``out``, and the maps' pages are released as tensors are done.
    """
    opt = options or DeltaOptions()
    old, new = Path(old), Path(new)
    out = check_output_path(out, (old, new), overwrite=True)
    spool = _Spool(out.parent)
    payload = tempfile.TemporaryFile(dir=out.parent, prefix=f".{out.name}.payload.")
    try:
        with Package.open(old) as old_pkg, Package.open(new) as new_pkg:
            files = _Files(old, new)
            planner = None
            try:
                planner = _Planner(old_pkg, new_pkg, files, opt)
                choices = _order(_plan(planner, opt, spool))
                files.release("new")
                files.release("old")
                if progress:
                    progress("planned")
                header, digest, stats = _assemble(choices, planner, opt, spool, payload)
                header = DeltaHeader(
                    base_file_size=files.old.size,
                    base_header_digest=old_pkg.preamble.header_digest,
                    base_file_sha256=_sha256_file(old),
                    target_file_size=files.new.size,
                    target_header_digest=new_pkg.preamble.header_digest,
                    target_file_sha256=_sha256_file(new),
                    payload_sha256=digest,
                    streams=header.streams,
                    ops=header.ops,
                )
            finally:
                planner = None
                files.close()
        spool.close()
        validate(header, payload.tell())
        size = _write(out, header, payload, signing_keys, opt, old)
    finally:
        spool.close()
        payload.close()
    stats.path, stats.size = out, size
    return stats


def _assemble(
    choices: list[_Choice], planner: _Planner, opt: DeltaOptions, spool: _Spool, payload
) -> tuple[DeltaHeader, bytes, DeltaStats]:
    """The op table and stream records; the streams' blobs are appended to ``payload``
    in stream order. Returns ``(header, payload SHA-256, stats)``."""
    stats = DeltaStats(Path(), 0, len(choices), 0, 0, 0, 0)
    class_index: dict[tuple, int] = {}
    stream_parts: list[list[_Spilled]] = []
    stream_dicts: list[tuple[int, int]] = []
    ops: list[Op] = []
    position = {id(c): i for i, c in enumerate(choices)}
    _spill(choices, spool)  # header, sections, gaps: the few not spilled while planning
    for c in choices:
        op = c.op
        if c.factors_of is not None:
            pred = dataclasses.replace(op.prediction, factors=1 + position[id(c.factors_of)])
            op = dataclasses.replace(op, prediction=pred)
        stats.methods[c.method] += 1
        stats.method_bytes[c.method] += c.probe_size
        if op.kind == OpKind.COPY:
            stats.copied += op.length
        elif op.kind == OpKind.ZERO:
            stats.zero += op.length
        else:
            stats.coded += op.length  # (FACTORS ops have length 0)
            key = (c.stream_class, c.dict_span) if c.stream_class else None
            index = class_index.get(key) if key else None
            if index is None:
                index = len(stream_parts)
                if key:
                    class_index[key] = index
                stream_parts.append([])
                stream_dicts.append(c.dict_span)
            stream_parts[index].append(c.residual)
            op = _with_stream(op, index)
            if c.aux is not None:
                akey = (c.aux_class, (0, 0))
                aindex = class_index.get(akey)
                if aindex is None:
                    aindex = class_index[akey] = len(stream_parts)
                    stream_parts.append([])
                    stream_dicts.append((0, 0))
                stream_parts[aindex].append(c.aux)
                op = dataclasses.replace(op, aux_stream=aindex)
        ops.append(op)

    def encode(i: int) -> tuple[Stream, bytes]:
        data = spool.gather(stream_parts[i])
        stream_parts[i] = []
        off, n = stream_dicts[i]
        dict_bytes = planner.files.old[off : off + n].tobytes() if n else None
        codec, blob = _compress(data, opt.level, dict_bytes)
        if codec == Codec.STORED:
            off = n = 0
        return Stream(codec, len(blob), len(data), off, n), blob

    streams: list[Stream] = []
    digest = hashlib.sha256()
    workers = max(1, opt.workers)
    with ThreadPoolExecutor(workers) as pool:
        for stream, blob in _bounded_map(pool, encode, range(len(stream_parts)), workers):
            streams.append(stream)
            digest.update(blob)
            payload.write(blob)
    stats.streams = len(streams)
    header = DeltaHeader(0, b"", b"", 0, b"", b"", b"", tuple(streams), tuple(ops))
    return header, digest.digest(), stats


def _with_stream(op: Op, stream: int) -> Op:
    return dataclasses.replace(op, stream=stream)


def _write(out: Path, header: DeltaHeader, payload, keys, opt: DeltaOptions, old: Path) -> int:
    header_bytes = encode_header(header)
    digest = header_digest(header_bytes)
    signature = build_signature_block(digest, keys) if keys else b""
    payload_length = payload.tell()
    payload_offset = PREAMBLE_SIZE + len(header_bytes)
    pre = DeltaPreamble(
        header_offset=PREAMBLE_SIZE,
        header_length=len(header_bytes),
        payload_offset=payload_offset,
        payload_length=payload_length,
        header_digest=digest,
        signature_offset=payload_offset + payload_length if signature else 0,
        signature_length=len(signature),
    )
    remove_stale_partials(out)  # what a killed diff of this path left
    fd, tmp = create_partial(out)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pre.pack())
            f.write(header_bytes)
            payload.seek(0)
            shutil.copyfileobj(payload, f, _HASH_CHUNK)
            f.write(signature)
            seal_output(f)  # served to devices: not mkstemp's 0600
        if opt.verify:
            check_dir = create_scratch_dir(out)
            try:
                apply_delta(old, tmp, check_dir / "target.epk")
            finally:
                shutil.rmtree(check_dir, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return pre.file_size
