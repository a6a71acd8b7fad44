"""Phase 1, import: the source model as float32 tensors, and the float reference the
runtime runs for calibration, the probe and the verification.

The runtime opens package files only (``runtime_shim.open(path)``), so the float
reference is a float32 package: written once (the writer puts every tensor in place, no
spool copy), opened once, and read back tensor by tensor (read, not mapped, so the pages
the build touches do not stay in its resident set). Where it goes is a matter of memory:
in RAM (``/dev/shm``) when the machine has room for it twice over, so nothing goes
through a disk; on disk next to the output only when the float model does not fit in
memory (:func:`float_dir`). A float ``.epk`` source is used as it is (nothing written).
The file lives in a scratch directory named after the output and the build's pid
(``edgepack.format.output_file``'s rule), the build says where and how big it is, and
the next build of the same output clears what a killed one left (:func:`remove_stale_scratch`).
The RAM file *is* the in-memory float reference: one float32 copy serves the runtime's
mapping and the build's reads, where separate arrays would be a second one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgepack.format import (
    Encoding,
    ModelIdentity,
    Package,
    PackageWriter,
    Provenance,
    SectionKind,
)
from edgepack.format.model_card import read_model_card
from edgepack.format.output_file import create_scratch_dir, remove_stale_partials
from edgepack.format.writer import PackageSizer
from edgepack.runtime_shim import runtime_version

from ..convert import required_operators
from ..errors import QuantizedSourceError
from ..model_card import Fields, card_from_json, card_section, source_card
from ..quantizers.awq import Transforms
from .result import Progress

__all__ = ["FloatModel", "float_dir", "open_float", "remove_stale_scratch", "static_sections"]

_SHM = Path("/dev/shm")
_RAM_HEADROOM = 2  # the float reference goes to RAM while RAM holds it this many times


@dataclass
class FloatModel:
    """The model as float32 tensors, read from the source; when calibration needs it, a
    float package the runtime opens once (float activations and KV cache, numpy kernels),
    from which every tensor is then read (see the module docstring for where it lives)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    identity: ModelIdentity
    tokenizer_json: str | None
    chat_template: str | None
    model_config: bytes | None
    source_name: str
    source_sha256: str
    reader: Callable[[str], np.ndarray]
    path: Path | None = None  # the float package, once there is one
    model: Any = None  # edgepack.runtime_shim.Model on it
    temporary: bool = False
    float_ready: bool = False  # ``path`` holds the complete float package
    transforms: Transforms = field(default_factory=Transforms)
    card: Fields = field(default_factory=dict)  # model-card fields (..model_card)

    def raw(self, name: str) -> np.ndarray:
        if self.float_ready and self._float_package():
            return self._pread(name)
        return np.ascontiguousarray(self.reader(name), np.float32)

    def _float_package(self) -> bool:
        if getattr(self, "_entries", None) is None:
            with Package.open(self.path) as pkg:
                self._entries = {t.name: t for t in pkg.header.tensors}
        return all(t.encoding == Encoding.F32 for t in self._entries.values())

    def can_read_rows(self, name: str) -> bool:
        return self.float_ready and self._float_package() and name not in self.transforms.cols

    def read_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows ``r0:r1`` of a 2-D tensor of the float package (read, not mapped)."""
        t = self._entries[name]
        cols = math.prod(t.shape[1:])
        with open(self.path, "rb") as f:
            f.seek(t.codes.offset + r0 * cols * 4)
            a = np.fromfile(f, dtype="<f4", count=(r1 - r0) * cols)
        w = a.astype(np.float32, copy=False).reshape(r1 - r0, cols)
        if name in self.transforms.rows:
            w = w * self.transforms.rows[name][r0:r1, None]
        return np.ascontiguousarray(w, np.float32)

    def _pread(self, name: str) -> np.ndarray:
        """A tensor of the float32 package, read (not mapped): pages the build touches do
        not stay in its resident set."""
        t = self._entries[name]
        n = math.prod(t.shape)
        with open(self.path, "rb") as f:
            f.seek(t.codes.offset)
            a = np.fromfile(f, dtype="<f4", count=n)
        if a.size != n:
            raise ValueError(f"{name}: short read from {self.path}")
        return a.astype(np.float32, copy=False).reshape(t.shape)

    def load(self, name: str) -> np.ndarray:
        """float32 tensor, with the AWQ / SmoothQuant scalings applied."""
        w = self.raw(name)
        return self.transforms.apply(name, w) if self.transforms else w

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def ensure_model(self, out: Path, progress: Progress) -> None:
        """Open the float model on the runtime, writing the float reference first unless
        the source is one: in memory when it fits, else beside ``out`` (:func:`float_dir`)."""
        if self.model is not None:
            return
        if self.path is None:
            sizer, sections = self._float_sizer()
            nbytes = sizer.file_size()
            where = float_dir(nbytes, out.parent)
            scratch = create_scratch_dir(where / out.name)
            self.path, self.temporary = scratch / "float.epk", True
            medium = "RAM" if where == _SHM else "disk: the model does not fit in memory"
            progress.log(
                f"float reference: {nbytes:,} bytes in {scratch} ({medium}), "
                "removed when the build ends"
            )
            try:
                self._write_float(progress, sizer, sections)
            except BaseException:
                shutil.rmtree(scratch, ignore_errors=True)
                raise
            self.reader = _no_reader  # drop the source (its mapping) for good
            self.float_ready = True
        from edgepack.runtime_shim import open as open_model

        self.model = open_model(
            self.path, kv="float", activations="float", kernels="numpy", verify="none"
        )

    def _float_sizer(self) -> tuple[PackageSizer, list[tuple[SectionKind, bytes, str, str]]]:
        """The float reference laid out (its exact size, before anything is written)."""
        sizer = PackageSizer(self.identity, **self._float_fields())
        sections = static_sections(self)
        for name, shape in zip(self.names, self.shapes, strict=True):
            sizer.declare_tensor(name, Encoding.F32, shape)
        for kind, data, sname, media in sections:
            sizer.add_section(kind, data, name=sname, media_type=media)
        return sizer, sections

    def _float_fields(self) -> dict[str, Any]:
        prov = Provenance(
            tool="edgepack",
            tool_version=runtime_version(),
            source_name=self.source_name,
            source_sha256=self.source_sha256,
        )
        ops = required_operators(self.identity.architecture, {Encoding.F32})
        return {"required_operators": ops, "provenance": prov}

    def _write_float(
        self,
        progress: Progress,
        sizer: PackageSizer,
        sections: list[tuple[SectionKind, bytes, str, str]],
    ) -> None:
        assert self.path is not None
        progress.phase("float model", len(self.names))
        with PackageWriter(
            self.path,
            self.identity,
            data_offset=sizer.data_offset,  # every tensor written in place, once
            **self._float_fields(),
        ) as w:
            for name in self.names:
                w.add_tensor(name, Encoding.F32, self.raw(name))
                progress.advance(1, name)
            for kind, data, sname, media in sections:
                w.add_section(kind, data, name=sname, media_type=media)
            w.finish()

    def release_model(self) -> None:
        """Unmap the runtime's view (the file stays; :meth:`ensure_model` reopens it)."""
        if self.model is not None:
            self.model.close()
            self.model = None

    def close(self) -> None:
        self.release_model()
        if self.temporary and self.path is not None:
            shutil.rmtree(self.path.parent, ignore_errors=True)  # the scratch directory


def float_dir(nbytes: int, workdir: Path) -> Path:
    """Where a float reference of ``nbytes`` goes: RAM (``/dev/shm``) while the available
    memory and the RAM disk hold it twice over; ``workdir`` (a disk) only when the float
    model does not fit in memory."""
    if _SHM.is_dir() and os.access(_SHM, os.W_OK):
        st = os.statvfs(_SHM)
        room = min(_available_memory(), st.f_bavail * st.f_frsize)
        if nbytes * _RAM_HEADROOM <= room:
            return _SHM
    return workdir


def remove_stale_scratch(out: Path) -> list[Path]:
    """Clear the float references killed builds of ``out`` left, in RAM and beside it
    (:func:`float_dir` may have chosen either); return them. A live build's is kept."""
    places = {out.parent, _SHM} if _SHM.is_dir() else {out.parent}
    return [p for where in sorted(places) for p in remove_stale_partials(where / out.name)]


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _no_reader(name: str) -> np.ndarray:
    raise AssertionError(f"{name}: the source was released (read the float package)")


def open_float(src: Path) -> FloatModel:
    """The source as a :class:`FloatModel` (nothing written yet); a model the runtime would
    not run exactly is refused here, before any work (``check_convertible``)."""
    from ..importers.config import check_convertible

    if src.suffix == ".epk":
        pkg = Package.open(src)
        try:
            if any(not t.encoding.is_float for t in pkg.header.tensors):
                raise QuantizedSourceError(
                    f"{src.name} is already quantized: build from the float source model "
                    "(safetensors, HF directory, GGUF or an f32/f16/bf16 package)"
                )
            h = pkg.header
            check_convertible(h.identity.architecture, h.identity.config)
            tok = pkg.section(SectionKind.TOKENIZER)
            chat = pkg.section(SectionKind.CHAT_TEMPLATE)
            prov = h.provenance
            fm = FloatModel(
                names=[t.name for t in h.tensors],
                shapes=[tuple(t.shape) for t in h.tensors],
                identity=h.identity,
                tokenizer_json=tok.decode() if tok is not None else None,
                chat_template=chat.decode() if chat is not None else None,
                model_config=pkg.section(SectionKind.MODEL_CONFIG),
                source_name=(prov.source_name if prov else "") or src.name,
                source_sha256=(prov.source_sha256 if prov else "") or "",
                reader=lambda name: pkg.dequantize(name),
                path=src,
                float_ready=True,
                card=card_from_json(read_model_card(pkg)),
            )
        except BaseException:
            pkg.close()
            raise
        fm._pkg = pkg  # type: ignore[attr-defined]  # closed with the build
        return fm
    from ..importers import open_source

    source = open_source(src)
    check_convertible(source.architecture, source.config)
    by_name = {t.name: t for t in source.tensors}
    raw = source.config.get("source_config")
    return FloatModel(
        names=[t.name for t in source.tensors],
        shapes=[tuple(t.shape) for t in source.tensors],
        identity=ModelIdentity(
            name=source.name,
            version="1.0.0",
            architecture=source.architecture,
            config={k: v for k, v in source.config.items() if k != "source_config"},
        ),
        tokenizer_json=source.tokenizer_json,
        chat_template=source.chat_template,
        model_config=(
            json.dumps(raw, sort_keys=True, default=str).encode() if raw is not None else None
        ),
        source_name=", ".join(p.name for p in source.source_files),
        source_sha256=source.source_sha256,
        reader=lambda name: by_name[name].load(),
        card=source_card(source.source_files, raw),
    )


def static_sections(fm: FloatModel) -> list[tuple[SectionKind, bytes, str, str]]:
    """Sections copied from the source."""
    out = []
    if fm.tokenizer_json:
        out.append(
            (
                SectionKind.TOKENIZER,
                fm.tokenizer_json.encode(),
                "tokenizer.json",
                "application/json",
            )
        )
    if fm.chat_template:
        out.append(
            (SectionKind.CHAT_TEMPLATE, fm.chat_template.encode(), "default", "text/x-jinja2")
        )
    if fm.model_config:
        out.append((SectionKind.MODEL_CONFIG, fm.model_config, "source", "application/json"))
    card = card_section(fm.card)
    if card is not None:
        out.append(card)
    return out

