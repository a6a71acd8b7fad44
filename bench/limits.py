"""Worst cases the format's limits allow: what opening the largest header and rejecting
the largest delta op table cost (time, peak RSS), each in a fresh process.

    .venv/bin/python bench/limits.py [--header-mib N] [--tensors N] [--ops N]

Defaults are the current limits (format/constants.py, format/delta/container.py); the
numbers go into spec/FORMAT.md section 3 and spec/DELTA.md section 5.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from edgepack.format.constants import (
    DATA_REGION_ALIGNMENT,
    MAX_HEADER_LENGTH,
    MAX_TENSORS,
    PREAMBLE_SIZE,
    SPAN_ALIGNMENT,
)
from edgepack.format.delta.container import MAX_OPS, DeltaHeader, Op, OpKind, encode_header
from edgepack.format.encodings import Encoding
from edgepack.format.header import Header, ModelIdentity, Span, TensorEntry
from edgepack.format.header import encode_header as enc
from edgepack.format.preamble import Preamble


def header_bomb(path: Path, header_limit: int, tensors: int) -> tuple[int, int]:
    """A valid package with up to ``tensors`` one-element tensors (as many as fit) whose
    names fill the header to just under ``header_limit``; returns (tensors, header bytes)."""
    per_tensor = 136  # encoded bytes of a tensor entry with an 8-byte name (measured)
    tensors = min(tensors, header_limit // per_tensor)
    name_len = max(8, min(512, header_limit // tensors - per_tensor + 8))
    while len(enc(_many_tensors(tensors, name_len))) > header_limit:
        name_len -= 8
        if name_len < 8:
            name_len, tensors = 8, int(tensors * 0.98)
    encoded = enc(_many_tensors(tensors, name_len))
    data_offset = math.ceil((PREAMBLE_SIZE + len(encoded)) / DATA_REGION_ALIGNMENT)
    data_offset *= DATA_REGION_ALIGNMENT
    data_length = tensors * SPAN_ALIGNMENT
    header = _many_tensors(tensors, name_len, data_offset)
    encoded = enc(header)
    pre = Preamble(
        header_offset=PREAMBLE_SIZE,
        header_length=len(encoded),
        data_offset=data_offset,
        data_length=data_length,
        header_digest=hashlib.sha256(encoded).digest(),
    )
    with open(path, "wb") as f:
        f.write(pre.pack() + encoded)
        f.truncate(data_offset + data_length)
    return tensors, len(encoded)


def _many_tensors(n: int, name_len: int, data_offset: int = 0) -> Header:
    tensors = tuple(
        TensorEntry(
            name=f"{i:08d}".ljust(name_len, "x"),
            shape=(1,),
            encoding=Encoding.F32,
            codes=Span(data_offset + i * SPAN_ALIGNMENT, 4),
            hash=bytes(32),
        )
        for i in range(n)
    )
    return Header(ModelIdentity("bomb", "1.0.0", "llama"), "0.1.0", tensors=tensors)


def delta_bomb(path: Path, ops: int) -> int:
    """A delta header of ``ops`` one-byte ZERO ops tiling the target: every op passes
    validation, so the reader pays for all of them; returns its length."""
    h = DeltaHeader(
        base_file_size=1,
        base_header_digest=bytes(32),
        base_file_sha256=bytes(32),
        target_file_size=ops,
        target_header_digest=bytes(32),
        target_file_sha256=bytes(32),
        payload_sha256=hashlib.sha256(b"").digest(),
        ops=tuple(Op(OpKind.ZERO, i, 1) for i in range(ops)),
    )
    raw = encode_header(h)
    path.write_bytes(raw)
    return len(raw)


_MEASURE = """
import json, re, sys, time
start = time.perf_counter()
try:
    {body}
    outcome = "accepted"
except Exception as exc:
    outcome = type(exc).__name__ + ": " + str(exc)[:80]
seconds = time.perf_counter() - start
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec from the parent
hwm = re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read())
print(json.dumps({{"seconds": seconds, "outcome": outcome, "peak_mib": int(hwm[1]) / 1024}}))
"""


def measure(body: str) -> dict:
    script = textwrap.dedent(_MEASURE).format(body=body)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--header-mib", type=float, default=MAX_HEADER_LENGTH / (1 << 20))
    ap.add_argument("--tensors", type=int, default=MAX_TENSORS)
    ap.add_argument("--ops", type=int, default=MAX_OPS)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        pkg = Path(d) / "header.epk"
        tensors, n = header_bomb(pkg, int(args.header_mib * (1 << 20)), args.tensors)
        base = measure("")
        r = measure(f"from edgepack.format import Package\n    Package.open({str(pkg)!r}).close()")
        print(
            f"open, {tensors} tensors, {n / (1 << 20):.1f} MiB header: "
            f"{r['seconds']:.2f} s, peak {r['peak_mib']:.0f} MiB "
            f"(interpreter alone {base['peak_mib']:.0f} MiB) -> {r['outcome']}"
        )
        delta = Path(d) / "ops.hdr"
        n = delta_bomb(delta, args.ops)
        r = measure(
            "from edgepack.format.delta.container import decode_header, validate\n"
            f"    validate(decode_header(open({str(delta)!r}, 'rb').read()))"
        )
        print(
            f"delta header, {args.ops} ops, {n / (1 << 20):.1f} MiB: decode + validate "
            f"{r['seconds']:.2f} s, peak {r['peak_mib']:.0f} MiB -> {r['outcome']}"
        )


if __name__ == "__main__":
    main()
