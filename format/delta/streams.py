"""Decoding DATA op inputs: payload streams (stored or zstd) and shuffled residuals.

Everything is pulled on demand in bounded pieces: a zstd frame is fed 128 compressed
bytes at a time (a zstd block expands at most 128 KiB, so one feed yields a few MiB at
worst, even from a decompression bomb), and a shuffled residual is undone one 1 MiB
block at a time. Malformed input raises :class:`CorruptDeltaError`.
"""

from __future__ import annotations

import numpy as np
import zstandard

from .container import MAX_ZSTD_WINDOW, SHUFFLE_BLOCK, Codec, Shuffle, Stream
from .errors import CorruptDeltaError
from .rans import RansDecoder
from .transforms import sparse_block, unshuffle_block

__all__ = ["ResidualReader", "StreamDecoder"]

_FEED = 128
_STORED_READ = 1 << 20
_RANS_READ = 1 << 16


class StreamDecoder:
    """The decoded bytes of one stream, read front to back.

    ``read_delta(offset, n)`` and ``read_base(offset, n)`` return bytes of the delta and
    base files (absolute offsets); ``blob_offset`` is the blob's absolute offset.
    """

    def __init__(self, index: int, stream: Stream, blob_offset: int, read_delta, read_base):
        self.index = index
        self.stream = stream
        self._read_delta = read_delta
        self._blob_offset = blob_offset
        self._fed = 0
        self._produced = 0
        self._buf = bytearray()
        self._obj = None
        self._rans: RansDecoder | None = None
        if stream.codec == Codec.ZSTD:
            self._obj = self._zstd_object(read_base)
        elif stream.codec == Codec.RANS:
            self._rans = RansDecoder(
                lambda off, n: read_delta(blob_offset + off, n),
                stream.blob_length,
                stream.decoded_length,
            )

    def _zstd_object(self, read_base):
        s = self.stream
        head = self._read_delta(self._blob_offset, min(s.blob_length, 18))
        try:
            params = zstandard.get_frame_parameters(head)
        except zstandard.ZstdError as exc:
            raise CorruptDeltaError(
                f"delta stream {self.index} is not a zstd frame: {exc}"
            ) from None
        if params.content_size != s.decoded_length:
            raise CorruptDeltaError(f"delta stream {self.index}: zstd content size mismatch")
        if params.window_size > MAX_ZSTD_WINDOW:
            raise CorruptDeltaError(f"delta stream {self.index}: zstd window too large")
        try:
            kwargs = {"max_window_size": MAX_ZSTD_WINDOW}
            if s.dict_length:
                raw = read_base(s.dict_offset, s.dict_length)
                kwargs["dict_data"] = zstandard.ZstdCompressionDict(
                    raw, dict_type=zstandard.DICT_TYPE_RAWCONTENT
                )
            return zstandard.ZstdDecompressor(**kwargs).decompressobj(read_across_frames=False)
        except zstandard.ZstdError as exc:
            raise CorruptDeltaError(f"delta stream {self.index}: {exc}") from None

    def read(self, n: int) -> bytes:
        """Exactly the next ``n`` decoded bytes."""
        if self._produced + n > self.stream.decoded_length:
            raise CorruptDeltaError(f"delta stream {self.index} is read past its end")
        if self._rans is not None:
            while len(self._buf) < n:
                more = self._rans.decode(max(n - len(self._buf), _RANS_READ))
                if not more:  # unreachable: read() never asks past decoded_length
                    raise CorruptDeltaError(f"delta stream {self.index} ends early")
                self._buf += more
            out = bytes(self._buf[:n])
            del self._buf[:n]
            self._produced += n
            return out
        if self._obj is None:
            data = self._read_delta(self._blob_offset + self._produced, n)
            self._produced += n
            return data
        buf = self._buf
        while len(buf) < n:
            if self._fed >= self.stream.blob_length or self._obj.eof:
                raise CorruptDeltaError(f"delta stream {self.index} ends early")
            size = min(_FEED, self.stream.blob_length - self._fed)
            chunk = self._read_delta(self._blob_offset + self._fed, size)
            self._fed += size
            try:
                buf += self._obj.decompress(chunk)
            except zstandard.ZstdError as exc:
                raise CorruptDeltaError(f"delta stream {self.index} is corrupt: {exc}") from None
        out = bytes(buf[:n])
        del buf[:n]
        self._produced += n
        return out

    def close(self) -> None:
        """Check the stream was consumed exactly: frame ended, no bytes left over."""
        s = self.stream
        if self._produced != s.decoded_length:
            raise CorruptDeltaError(f"delta stream {self.index} was not fully used")
        if self._rans is not None:
            if self._buf:  # unreachable: decoding stops at decoded_length
                raise CorruptDeltaError(f"delta stream {self.index} decoded too much")
            self._rans.finish()
            self._rans = None
            return
        if self._obj is None:
            return
        while not self._obj.eof and self._fed < s.blob_length and not self._buf:
            size = min(_FEED, s.blob_length - self._fed)
            try:
                self._buf += self._obj.decompress(
                    self._read_delta(self._blob_offset + self._fed, size)
                )
            except zstandard.ZstdError as exc:
                raise CorruptDeltaError(f"delta stream {self.index} is corrupt: {exc}") from None
            self._fed += size
        if self._buf or not self._obj.eof or self._obj.unused_data or self._fed != s.blob_length:
            raise CorruptDeltaError(f"delta stream {self.index} has bytes after its frame")
        self._obj = None


class ResidualReader:
    """The residual of one DATA op: ``length`` bytes, decoded from its stream (byte
    shuffle undone, or sparse blocks expanded) one 2^20-byte block at a time."""

    def __init__(
        self,
        stream: StreamDecoder,
        length: int,
        elem: int,
        mode: int = Shuffle.NONE,
        aux: StreamDecoder | None = None,
    ) -> None:
        self._stream = stream
        self._aux = aux  # SPARSE: the non-zero bytes; PLANES: the planes after the first
        self._mode = mode
        self._left = length  # residual bytes not yet decoded
        self._elem = elem
        self._pending = np.empty(0, np.uint8)
        self.stream_bytes = 0  # taken from ``stream`` so far
        self.aux_bytes = 0  # taken from ``aux`` so far

    def _take(self, n: int) -> bytes:
        self.stream_bytes += n
        return self._stream.read(n)

    def _take_aux(self, n: int) -> bytes:
        assert self._aux is not None
        self.aux_bytes += n
        return self._aux.read(n)

    def _next_block(self) -> np.ndarray:
        size = min(SHUFFLE_BLOCK, self._left)
        if size <= 0:
            raise CorruptDeltaError("delta op reads past its residual")
        self._left -= size
        if self._mode == Shuffle.SPARSE:
            return sparse_block(self._take, self._take_aux, size)
        if self._mode == Shuffle.PLANES:
            first = self._take(size // self._elem)
            block = np.frombuffer(first + self._take_aux(size - len(first)), np.uint8)
        else:
            block = np.frombuffer(self._take(size), np.uint8)
        return unshuffle_block(block, self._elem)

    def read(self, n: int) -> np.ndarray:
        if self._mode == Shuffle.NONE:
            self._left -= n
            return np.frombuffer(self._take(n), np.uint8)
        parts, have = [], 0
        while have < n:
            if not self._pending.size:
                self._pending = self._next_block()
            take = min(n - have, self._pending.size)
            parts.append(self._pending[:take])
            self._pending = self._pending[take:]
            have += take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
