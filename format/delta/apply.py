"""Open, check and apply a delta (spec/DELTA.md section 5), streaming and atomically.

:class:`DeltaFile` parses and validates a delta (and checks its signature); nothing is
read from the base until the delta itself is proven well formed. :func:`apply_delta`
then checks the base cheapest-first (size, header digest, SHA-256), the payload hash,
and writes the target into a temporary file next to it with positioned writes, a
fixed-size buffer and row-block predictions. The result must hash to the recorded
target before it is fsynced and renamed over the target path; on any failure the
temporary file is removed and the target path is left as it was.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgepack.format.file_mode import seal_output
from edgepack.format.output_file import (
    check_output_path,
    create_partial,
    remove_stale_partials,
)
from edgepack.format.signing import parse_signature_block, verify_signature_block

from .container import (
    Combine,
    DeltaHeader,
    DeltaPreamble,
    Op,
    OpKind,
    Part,
    RefKind,
    Shuffle,
    decode_header,
    header_digest,
    validate,
)
from .errors import (
    CorruptDeltaError,
    DeltaError,
    SignatureError,
    TargetMismatchError,
    TruncatedDeltaError,
    WrongBaseError,
)
from .predict import (
    BaseRows,
    Factors,
    predict_codes,
    predict_codes_directed,
    predict_part,
    row_bytes,
)
from .streams import ResidualReader, StreamDecoder
from .transforms import combine

__all__ = ["ApplyReport", "DeltaFile", "apply_delta"]

CHUNK = 1 << 20  # bytes per copy / combine / hash step
_AUX_MODES = (Shuffle.SPARSE, Shuffle.PLANES)  # DATA ops reading a second stream
ROW_BLOCK_ELEMENTS = 1 << 18  # elements per prediction step (~1 MiB of float32)
_PRE_LEN = 128


@dataclass(frozen=True)
class ApplyReport:
    target: Path
    target_size: int
    ops: int
    bytes_copied: int
    bytes_decoded: int
    signed: bool
    trusted_signers: tuple[str, ...]


_SHORT_READ = {"delta": TruncatedDeltaError, "base": WrongBaseError, "target": TargetMismatchError}


def _pread_exact(fd: int, n: int, offset: int, what: str) -> bytes:
    chunks, got = [], 0
    while got < n:
        data = os.pread(fd, n - got, offset + got)
        if not data:
            raise _SHORT_READ[what](f"{what} file ended early (at byte {offset + got})")
        chunks.append(data)
        got += len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class DeltaFile:
    """A parsed, validated delta. Use :meth:`open` and as a context manager."""

    def __init__(self, path: Path, fd: int, pre: DeltaPreamble, header: DeltaHeader) -> None:
        self.path = path
        self._fd = fd
        self.preamble = pre
        self.header = header

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> DeltaFile:
        path = Path(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            pre = DeltaPreamble.unpack(os.pread(fd, _PRE_LEN, 0), size)
            raw = _pread_exact(fd, pre.header_length, pre.header_offset, "delta")
            if header_digest(raw) != pre.header_digest:
                raise CorruptDeltaError("delta header digest mismatch: the header was modified")
            header = validate(decode_header(raw), pre.payload_length)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, pre, header)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DeltaFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, offset: int, n: int) -> bytes:
        return _pread_exact(self._fd, n, offset, "delta")

    def signature_block(self) -> bytes:
        pre = self.preamble
        return (
            self.read(pre.signature_offset, pre.signature_length) if pre.signature_length else b""
        )

    def verify_signature(
        self, trusted_keys: Sequence[object] | None, threshold: int = 1
    ) -> list[bytes]:
        """Key ids of trusted signers; without keys only checks the block is well formed."""
        block = self.signature_block()
        if trusted_keys is None:
            if block:
                parse_signature_block(block)
            return []
        if not block:
            raise SignatureError("delta is not signed, and trusted keys were required")
        return verify_signature_block(
            block, self.preamble.header_digest, list(trusted_keys), threshold
        )

    def check_payload(self) -> None:
        digest = hashlib.sha256()
        start, end = self.preamble.payload_offset, self.preamble.payload_end
        for pos in range(start, end, CHUNK):
            digest.update(self.read(pos, min(CHUNK, end - pos)))
        if digest.digest() != self.header.payload_sha256:
            raise CorruptDeltaError("delta payload hash mismatch: the delta is corrupt")


def check_base(fd: int, h: DeltaHeader, *, full_hash: bool = True) -> None:
    """Refuse a base that is not the file the delta was made from, cheapest check first."""
    size = os.fstat(fd).st_size
    if size != h.base_file_size:
        raise WrongBaseError(
            f"base is {size} bytes, the delta was made from a {h.base_file_size}-byte package"
        )
    head = os.pread(fd, 96, 0)
    if len(head) < 96 or head[64:96] != h.base_header_digest:
        raise WrongBaseError(
            "base package header differs from the delta's base "
            f"(expected header digest {h.base_header_digest.hex()[:16]})"
        )
    if full_hash:
        digest = hashlib.sha256()
        for pos in range(0, size, CHUNK):
            digest.update(_pread_exact(fd, min(CHUNK, size - pos), pos, "base"))
        if digest.digest() != h.base_file_sha256:
            raise WrongBaseError("base package bytes differ from the delta's base (corrupt base?)")


def apply_delta(
    base: str | os.PathLike[str],
    delta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    trusted_keys: Sequence[object] | None = None,
    threshold: int = 1,
    check_base_hash: bool = True,
    max_target_size: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> ApplyReport:
    """Write ``out`` = ``base`` patched by ``delta``; see the module docstring.

    ``max_target_size`` bounds the file a delta may make us write (default: four times
    the base plus 1 GiB), so a forged delta of huge zero runs cannot fill the disk.
    """
    out = check_output_path(out, (base, delta), overwrite=True)
    remove_stale_partials(out)  # what a killed patch of this path left
    with DeltaFile.open(delta) as d:
        h = d.header
        limit = max_target_size if max_target_size is not None else 4 * h.base_file_size + (1 << 30)
        if h.target_file_size > limit:
            raise CorruptDeltaError(
                f"delta would write a {h.target_file_size}-byte file, more than the "
                f"{limit} bytes allowed for this base"
            )
        signers = d.verify_signature(trusted_keys, threshold)
        base_fd = os.open(base, os.O_RDONLY)
        try:
            check_base(base_fd, h, full_hash=check_base_hash)
            d.check_payload()
            copied, decoded = _write_target(d, base_fd, out, progress)
        finally:
            os.close(base_fd)
    return ApplyReport(
        target=out,
        target_size=h.target_file_size,
        ops=len(h.ops),
        bytes_copied=copied,
        bytes_decoded=decoded,
        signed=d.preamble.signature_length > 0,
        trusted_signers=tuple(k.hex() for k in signers),
    )


def _write_target(d: DeltaFile, base_fd: int, out: Path, progress) -> tuple[int, int]:
    h = d.header
    fd, tmp = create_partial(out)
    try:
        try:
            os.posix_fallocate(fd, 0, h.target_file_size)  # fail early on a full disk
        except AttributeError:  # not on this platform
            os.ftruncate(fd, h.target_file_size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(fd, h.target_file_size)
        runner = _Runner(d, base_fd, fd)
        for i, op in enumerate(h.ops):
            runner.run(i, op)
            if progress:
                progress(op.length)
        runner.finish()
        digest = hashlib.sha256()
        for pos in range(0, h.target_file_size, CHUNK):
            n = min(CHUNK, h.target_file_size - pos)
            digest.update(_pread_exact(fd, n, pos, "target"))
        if os.fstat(fd).st_size != h.target_file_size or digest.digest() != h.target_file_sha256:
            raise TargetMismatchError(
                "patched file does not match the delta's target hash (corrupt base or delta)"
            )
        seal_output(fd)  # a package others (a web server) read: not mkstemp's 0600
        os.close(fd)
        fd = -1
        os.replace(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return runner.copied, runner.decoded


def _fsync_dir(path: Path) -> None:
    try:
        dfd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


class _Runner:
    """Runs ops in table order against the base fd and the output fd."""

    def __init__(self, d: DeltaFile, base_fd: int, out_fd: int) -> None:
        self.d = d
        self.h = d.header
        self.base_fd = base_fd
        self.out_fd = out_fd
        self.copied = 0
        self.decoded = 0
        offsets = self.h.blob_offsets()
        self._blob_abs = [d.preamble.payload_offset + o for o in offsets]
        self._decoders: dict[int, StreamDecoder] = {}
        self._last_use: dict[int, int] = {}  # stream -> index of the last op reading it
        self._factors: dict[int, Factors] = {}  # FACTORS op index -> its correction
        self._factors_last_use: dict[int, int] = {}
        for i, op in enumerate(self.h.ops):
            if op.kind in (OpKind.DATA, OpKind.FACTORS):
                self._last_use[op.stream] = i
            if op.kind == OpKind.DATA and op.shuffle in _AUX_MODES:
                self._last_use[op.aux_stream] = i
            if op.prediction is not None and op.prediction.factors:
                self._factors_last_use[op.prediction.factors - 1] = i

    def read_base(self, offset: int, n: int) -> bytes:
        return _pread_exact(self.base_fd, n, offset, "base")

    def read_target(self, offset: int, n: int) -> bytes:
        return _pread_exact(self.out_fd, n, offset, "target")

    def run(self, i: int, op: Op) -> None:
        if op.kind == OpKind.ZERO:
            return  # the preallocated file reads as zeros
        if op.kind == OpKind.COPY:
            self._copy(op)
            self.copied += op.length
            return
        decoder = self._decoder(op.stream)
        if op.kind == OpKind.FACTORS:
            if i in self._factors_last_use:  # unused factors are read and dropped
                self._factors[i] = Factors(decoder.read(op.factor_bytes), op.rows, op.cols, op.rank)
            else:
                decoder.read(op.factor_bytes)
            self._done_with_stream(i, op.stream)
            return
        has_aux = op.shuffle in _AUX_MODES
        aux = self._decoder(op.aux_stream) if has_aux else None
        residual = ResidualReader(decoder, op.length, op.elem_bytes, op.shuffle, aux)
        if op.ref_kind == RefKind.PREDICTED:
            self._predicted(op, residual)
        else:
            for pos in range(0, op.length, CHUNK):
                n = min(CHUNK, op.length - pos)
                res = residual.read(n)
                ref = None
                if op.ref_kind == RefKind.BASE:
                    ref = np.frombuffer(self.read_base(op.ref_offset + pos, n), np.uint8)
                _pwrite_all(
                    self.out_fd, combine(res, ref, op.combine, op.width), op.target_offset + pos
                )
        if residual.stream_bytes != op.stream_bytes or residual.aux_bytes != op.aux_bytes:
            raise CorruptDeltaError(f"delta op {i}: residual does not fill its stream bytes")
        self.decoded += op.length
        self._done_with_stream(i, op.stream)
        if has_aux and op.aux_stream != op.stream:
            self._done_with_stream(i, op.aux_stream)
        if op.prediction is not None and op.prediction.factors:
            j = op.prediction.factors - 1
            if self._factors_last_use.get(j) == i:
                del self._factors[j]

    def _decoder(self, index: int) -> StreamDecoder:
        decoder = self._decoders.get(index)
        if decoder is None:
            s = self.h.streams[index]
            decoder = StreamDecoder(index, s, self._blob_abs[index], self.d.read, self.read_base)
            self._decoders[index] = decoder
        return decoder

    def _done_with_stream(self, i: int, index: int) -> None:
        if self._last_use.get(index) == i:
            self._decoders.pop(index).close()

    def finish(self) -> None:
        if self._decoders:  # unreachable after validate(); kept as a guard
            raise CorruptDeltaError("delta streams left unfinished")

    def _copy(self, op: Op) -> None:
        src, dst, left = op.base_offset, op.target_offset, op.length
        while left:
            try:
                n = os.copy_file_range(self.base_fd, self.out_fd, left, src, dst)
            except (AttributeError, OSError):
                n = 0
            if n <= 0:  # unsupported here, or the base ended: do it by hand
                n = min(CHUNK, left)
                _pwrite_all(self.out_fd, self.read_base(src, n), dst)
            src, dst, left = src + n, dst + n, left - n

    def _predicted(self, op: Op, residual: ResidualReader) -> None:
        p = op.prediction
        assert p is not None
        base = BaseRows(
            self.read_base,
            p.base_encoding,
            p.cols,
            p.base_group_size,
            (p.base_codes_offset, p.base_scales_offset, p.base_zeros_offset),
        )
        factors = self._factors[p.factors - 1] if p.factors else None
        per_row = row_bytes(p.target_encoding, p.cols, p.target_group_size)
        step = max(1, ROW_BLOCK_ELEMENTS // p.cols)
        for r0 in range(0, p.rows, step):
            r1 = min(p.rows, r0 + step)
            w = base.dequantize(r0, r1, factors)
            if p.part == Part.CODES:
                scales = self.read_target(
                    p.target_scales_offset + r0 * per_row[1], (r1 - r0) * per_row[1]
                )
                zeros = None
                if per_row[2]:
                    zeros = self.read_target(
                        p.target_zeros_offset + r0 * per_row[2], (r1 - r0) * per_row[2]
                    )
                args = (w, p.target_encoding, p.target_group_size, scales, zeros)
                if op.combine == Combine.ADD_DIRECTED:
                    ref, negate = predict_codes_directed(*args)
                else:
                    ref, negate = predict_codes(*args), None
            else:
                ref = predict_part(w, p.target_encoding, p.target_group_size, p.part)
                negate = None
            n = (r1 - r0) * per_row[p.part]
            if ref.size != n:  # unreachable after validate(); a guard against logic errors
                raise DeltaError("prediction size mismatch")
            res = residual.read(n)
            _pwrite_all(
                self.out_fd,
                combine(res, ref, op.combine, op.width, negate),
                op.target_offset + r0 * per_row[p.part],
            )
