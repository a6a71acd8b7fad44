"""Benchmark tensor-aware deltas against generic binary diff tools (issue 5 bars).

Builds SmolLM2-135M packages (int4-g32 and int8) and, from each, the scenario pairs:

  a  LoRA fine-tune of q/v/o in every layer, merged into the release's float weights
     (the source model's) and re-quantized (rank 16, the update's Frobenius norm 1% of
     the weight's): as a release pipeline does it, and as the issue's GGUF reference
     pairs were made (~3.5% of the 4-bit codes move)
  b  the same on the last 4 blocks only
  A  as a, merged into OLD's dequantized weights instead (QLoRA-style: the fine-tune
     trained on the quantized base; the old values sit on the grid, so almost no code
     moves and nearly all the information is in the scales)
  B  as A on the last 4 blocks only
  c  a recipe change: ffn_down re-encoded (int4 package: at int8; int8 package: at
     int4-g32) from the same weights
  d  metadata only: version bump, provenance date, a release-notes METADATA_JSON section
  e  a new adapter only: a LORA_ADAPTER section (PEFT-style safetensors, f16) added

NEW packages are written with PackageWriter from the OLD package: unchanged tensors
byte for byte, changed ones re-encoded with ``encode_tensor`` from the source's float
weights (a, b) or the dequantized OLD weights (A, B, c), plus the update. For each
pair it prints our delta size, create and apply time and peak RSS beside ``bsdiff4``,
``xdelta3 -9 -B 256MiB`` and ``zstd -19 --long=28 --patch-from``, and the full
``zstd -19 --long=27`` size.
Each measured command runs in its own subprocess, so peak RSS is that of the work alone
(``resource.getrusage(RUSAGE_CHILDREN)`` after it ends, read in a one-job wrapper).

    python bench/delta.py [--quick] [--encodings int4,int8,int4s8] [--scenarios abABcde]
                          [--workdir DIR] [--json OUT.json] [--no-cache]

``--synthetic-1b`` instead builds a pair with the shapes of a 1.1B Llama (TinyLlama-1.1B:
hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads, vocab 32000, untied
embeddings) from random weights, every matrix at int4-g32, NEW with a merged rank-16 LoRA
on every linear weight of every third layer, and prints peak RSS and time of
``edgepack diff`` and ``edgepack patch`` (issue 12 item 6: the diff must stay under twice
the largest tensor as float32 plus 512 MiB). ``--layers N`` makes a smaller pair.

    python bench/delta.py --synthetic-1b [--layers 22] [--workdir DIR]

``--quick`` skips bsdiff4 and xdelta3 (bsdiff4 takes minutes and GiBs per pair). The
other tools' results are cached in the workdir by the SHA-256 of both packages, so a
re-run only re-measures ours (``--no-cache`` re-measures everything).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edgepack.format import Encoding, ModelIdentity, Package, PackageWriter, SectionKind
from edgepack.format.header import Provenance

LORA_RANK = 16
LORA_REL_NORM = 0.01
LORA_TARGETS = ("attn_q", "attn_v", "attn_o")
SCENARIOS = {
    "a": "LoRA q/v/o, all layers",
    "b": "LoRA q/v/o, last 4 blocks",
    "A": "LoRA q/v/o, all layers, on OLD's grid",
    "B": "LoRA q/v/o, last 4 blocks, on OLD's grid",
    "c": "ffn_down re-encoded",
    "d": "metadata only",
    "e": "new adapter section",
}


# ---------------------------------------------------------------- scenario packages


def _choice_of(entry):
    from edgepack.packager.encode import EncodingChoice

    return EncodingChoice(entry.encoding, entry.group_size)


def _layers(pkg: Package) -> int:
    return int(pkg.header.identity.config.get("num_hidden_layers", 0))


def write_variant(
    old_path: Path,
    new_path: Path,
    *,
    modify=None,
    version: str | None = None,
    provenance_update: dict | None = None,
    extra_sections: tuple = (),
) -> None:
    """Write NEW from OLD: ``modify(name, entry, pkg)`` returns None (keep the stored
    bytes) or ``(float32 weights, EncodingChoice)`` to re-encode. Weights of all changed
    tensors are computed first (the bench models are small)."""
    from edgepack.packager.encode import encode_tensor

    with Package.open(old_path) as pkg:
        h = pkg.header
        ident = h.identity
        identity = ModelIdentity(
            ident.name, version or ident.version, ident.architecture, dict(ident.config)
        )
        prov = h.provenance
        recipe = dict(prov.recipe or {})
        created = prov.created
        if provenance_update:
            created = provenance_update.pop("created", created)
            recipe.update(provenance_update)
        provenance = Provenance(
            prov.tool, prov.tool_version, prov.source_name, prov.source_sha256, recipe, created
        )
        ops = set(h.required_operators)
        changes = {}
        for t in h.tensors:
            change = modify(t.name, t, pkg) if modify else None
            if change is not None:
                changes[t.name] = change
                ops.add((change[1].encoding.info.operator, 1))
        with PackageWriter(
            new_path,
            identity,
            min_runtime_version=h.min_runtime_version,
            required_operators=sorted(ops),
            provenance=provenance,
        ) as w:
            for t in h.tensors:
                change = changes.pop(t.name, None)
                if t.encoding == Encoding.LOW_RANK or change is None:
                    w.copy_tensor(pkg, t.name)
                    continue
                weights, choice = change
                enc = encode_tensor(weights, choice, t.name)
                w.add_tensor(
                    t.name,
                    choice.encoding,
                    enc.codes,
                    enc.scales,
                    enc.zeros,
                    shape=t.shape,
                    group_size=choice.group_size,
                )
            for s in h.sections:
                data = pkg.section(s.kind, s.name)
                w.add_section(
                    s.kind,
                    data,
                    name=s.name,
                    media_type=s.media_type,
                    compress=s.compression == 1,
                    required=s.required,
                )
            for kind, name, data, media in extra_sections:
                w.add_section(kind, data, name=name, media_type=media)
            w.finish()


def lora_update(w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A rank-16 update whose Frobenius norm is 1% of ``w``'s."""
    rows, cols = w.shape[0], int(np.prod(w.shape[1:]))
    b = rng.standard_normal((rows, LORA_RANK)).astype(np.float32)
    a = rng.standard_normal((LORA_RANK, cols)).astype(np.float32)
    delta = b @ a
    delta *= LORA_REL_NORM * np.linalg.norm(w) / np.linalg.norm(delta)
    return delta.reshape(w.shape)


@functools.cache
def _source_model():
    """The sample model's importer (its float weights), the base packages' source."""
    from edgepack.packager.importers import open_source
    from edgepack.packager.sample_models import default_cache_dir, fetch_smollm2

    return open_source(fetch_smollm2(default_cache_dir()))


def _scenario_file(work: Path, encoding: str, scenario: str) -> Path:
    tag = {"a": "a-float", "b": "b-float", "A": "a-grid", "B": "b-grid"}.get(scenario, scenario)
    return work / f"smollm2-{encoding}-{tag}.epk"


def build_scenario(old: Path, new: Path, scenario: str, seed: int = 5) -> None:
    from edgepack.packager.encode import EncodingChoice

    rng = np.random.default_rng(seed)
    with Package.open(old) as probe:
        n_layers = _layers(probe)
    if scenario in "abAB":
        first = 0 if scenario in "aA" else n_layers - 4
        wanted = {f"layers.{i}.{t}.weight" for i in range(first, n_layers) for t in LORA_TARGETS}
        source = _source_model() if scenario in "ab" else None

        def modify(name, entry, pkg):
            if name not in wanted:
                return None
            w = source.tensor(name).load() if source is not None else pkg.dequantize(name)
            return w + lora_update(w, rng), _choice_of(entry)

        write_variant(old, new, modify=modify, provenance_update={"finetune": f"lora-{scenario}"})
    elif scenario == "c":

        def modify(name, entry, pkg):
            if not name.endswith("ffn_down.weight"):
                return None
            if entry.encoding == Encoding.INT8_CHANNEL:
                choice = EncodingChoice(Encoding.INT4_GROUP_SYM, 32)
            else:
                choice = EncodingChoice(Encoding.INT8_CHANNEL)
            return pkg.dequantize(name), choice

        write_variant(old, new, modify=modify, provenance_update={"ffn_down": "recoded"})
    elif scenario == "d":
        notes = json.dumps({"release_notes": "1.0.1: metadata refresh", "channel": "stable"})
        write_variant(
            old,
            new,
            version="1.0.1",
            provenance_update={"created": "2025-01-02T03:04:05Z"},
            extra_sections=((SectionKind.METADATA_JSON, "", notes.encode(), "application/json"),),
        )
    elif scenario == "e":
        write_variant(
            old,
            new,
            extra_sections=(
                (
                    SectionKind.LORA_ADAPTER,
                    "style-adapter",
                    _adapter_bytes(old, rng),
                    "application/x-safetensors",
                ),
            ),
        )
    else:
        raise ValueError(f"unknown scenario {scenario!r}")


def _adapter_bytes(old: Path, rng: np.random.Generator) -> bytes:
    """A PEFT-style LoRA adapter (rank 16 on q/v/o of every layer) as f16 safetensors."""
    from safetensors.numpy import save

    tensors = {}
    peft = {
        "attn_q": "self_attn.q_proj",
        "attn_v": "self_attn.v_proj",
        "attn_o": "self_attn.o_proj",
    }
    with Package.open(old) as pkg:
        for i in range(_layers(pkg)):
            for t in LORA_TARGETS:
                rows, cols = pkg.entry(f"layers.{i}.{t}.weight").shape
                prefix = f"base_model.model.model.layers.{i}.{peft[t]}"
                a = rng.standard_normal((LORA_RANK, cols)) / np.sqrt(cols)
                b = rng.standard_normal((rows, LORA_RANK)) * 0.01
                tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float16)
                tensors[f"{prefix}.lora_B.weight"] = b.astype(np.float16)
    return save(tensors, metadata={"r": str(LORA_RANK), "lora_alpha": "32"})


# ---------------------------------------------------------------- synthetic 1.1B pair

TINYLLAMA = {  # TinyLlama-1.1B's shapes
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}
SYNTHETIC_ENCODING = "int4-g32"
SYNTHETIC_CHANGED_EVERY = 3  # layers i with i % 3 == 2 get the merged LoRA


def synthetic_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of a Llama with ``config``, in file order."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    out = [("embed.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        out += [
            (p + "attn_norm.weight", (h,)),
            (p + "attn_q.weight", (h, h)),
            (p + "attn_k.weight", (kv, h)),
            (p + "attn_v.weight", (kv, h)),
            (p + "attn_o.weight", (h, h)),
            (p + "ffn_norm.weight", (h,)),
            (p + "ffn_gate.weight", (f, h)),
            (p + "ffn_up.weight", (f, h)),
            (p + "ffn_down.weight", (h, f)),
        ]
    return [*out, ("norm.weight", (h,)), ("output.weight", (v, h))]


def _synthetic_changed(name: str) -> bool:
    if not name.startswith("layers.") or name.endswith("norm.weight"):
        return False
    return int(name.split(".")[1]) % SYNTHETIC_CHANGED_EVERY == SYNTHETIC_CHANGED_EVERY - 1


def build_synthetic(old: Path, new: Path, layers: int, seed: int = 11) -> None:
    """Write the OLD/NEW pair tensor by tensor: one float matrix (and its update) is alive
    at a time, so the generator's memory is bounded by the embedding, not the model."""
    from edgepack.packager.encode import encode_tensor, parse_encoding

    config = dict(TINYLLAMA, num_hidden_layers=layers)
    choice = parse_encoding(SYNTHETIC_ENCODING)
    rng = np.random.default_rng(seed)
    writers = [
        PackageWriter(
            path,
            ModelIdentity("synthetic-1b", version, "llama", config),
            required_operators=[(choice.encoding.info.operator, 1)],
        )
        for path, version in ((old, "1.0.0"), (new, "1.0.1"))
    ]
    try:
        for name, shape in synthetic_shapes(config):
            if len(shape) == 1:
                w = np.ones(shape, np.float32)
                for writer in writers:
                    writer.add_tensor(name, Encoding.F32, w)
                continue
            w = rng.standard_normal(shape, dtype=np.float32)
            w *= 0.02
            encoded = [encode_tensor(w, choice, name)]
            if _synthetic_changed(name):
                w += lora_update(w, rng)
                encoded.append(encode_tensor(w, choice, name))
            del w
            for writer, enc in zip(writers, (encoded[0], encoded[-1]), strict=True):
                writer.add_tensor(
                    name,
                    choice.encoding,
                    enc.codes,
                    enc.scales,
                    enc.zeros,
                    shape=shape,
                    group_size=choice.group_size,
                )
        for writer in writers:
            writer.finish()
    except BaseException:
        for writer in writers:
            writer.abort()
        raise


# ---------------------------------------------------------------- measuring


@dataclass
class Measure:
    tool: str
    size: int | None = None
    create_s: float | None = None
    create_rss: int | None = None  # bytes
    apply_s: float | None = None
    apply_rss: int | None = None
    ok: bool = True
    note: str = ""


# Peak RSS of the work alone: VmHWM is reset at exec (ru_maxrss would inherit ours).
_PY_JOB = textwrap.dedent(
    """
    import sys, time
    kind = sys.argv[1]
    if kind == "ours-diff":
        from edgepack.server.delta import create_delta
        job = lambda: create_delta(sys.argv[2], sys.argv[3], sys.argv[4])
    elif kind == "ours-patch":
        from edgepack.format.delta import apply_delta
        job = lambda: apply_delta(sys.argv[2], sys.argv[3], sys.argv[4])
    elif kind == "bsdiff4-diff":
        import bsdiff4
        job = lambda: bsdiff4.file_diff(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        import bsdiff4
        job = lambda: bsdiff4.file_patch(sys.argv[2], sys.argv[4], sys.argv[3])
    start = time.perf_counter()
    job()
    seconds = time.perf_counter() - start
    hwm = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
    print(seconds, hwm)
    """
)


def _py_job(*args: str) -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PY_JOB, *args], check=True, capture_output=True, text=True
    )
    seconds, rss = out.stdout.split()[-2:]
    return float(seconds), int(rss)


def _timed(cmd: list[str]) -> tuple[float, int]:
    """Run an external command; (wall seconds, peak RSS bytes) via GNU time."""
    gnu_time = shutil.which("time") or "/usr/bin/time"
    if Path(gnu_time).exists():
        start = time.perf_counter()
        out = subprocess.run(
            [gnu_time, "-f", "@@%M", *cmd], check=True, capture_output=True, text=True
        )
        seconds = time.perf_counter() - start
        rss = int(out.stderr.rsplit("@@", 1)[1].split()[0]) * 1024
        return seconds, rss
    import psutil  # fallback: poll

    start = time.perf_counter()
    proc = psutil.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.02)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return time.perf_counter() - start, peak


def _same(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 22), fb.read(1 << 22)
            if x != y:
                return False
            if not x:
                return True


def measure_tool(tool: str, old: Path, new: Path, work: Path) -> Measure:
    delta = work / f"delta.{tool}"
    out = work / f"out.{tool}"
    m = Measure(tool)
    try:
        if tool == "ours":
            m.create_s, m.create_rss = _py_job("ours-diff", str(old), str(new), str(delta))
            m.apply_s, m.apply_rss = _py_job("ours-patch", str(old), str(delta), str(out))
        elif tool == "bsdiff4":
            m.create_s, m.create_rss = _py_job("bsdiff4-diff", str(old), str(new), str(delta))
            m.apply_s, m.apply_rss = _py_job("bsdiff4-patch", str(old), str(delta), str(out))
        elif tool == "xdelta3":
            m.create_s, m.create_rss = _timed(
                [
                    "xdelta3",
                    "-f",
                    "-9",
                    "-B",
                    "268435456",
                    "-e",
                    "-s",
                    str(old),
                    str(new),
                    str(delta),
                ]
            )
            m.apply_s, m.apply_rss = _timed(
                ["xdelta3", "-f", "-d", "-s", str(old), str(delta), str(out)]
            )
        elif tool == "zstd":
            m.create_s, m.create_rss = _timed(
                [
                    "zstd",
                    "-q",
                    "-f",
                    "-19",
                    "--long=28",
                    f"--patch-from={old}",
                    str(new),
                    "-o",
                    str(delta),
                ]
            )
            m.apply_s, m.apply_rss = _timed(
                [
                    "zstd",
                    "-q",
                    "-f",
                    "-d",
                    "--long=28",
                    f"--patch-from={old}",
                    str(delta),
                    "-o",
                    str(out),
                ]
            )
        m.size = delta.stat().st_size
        m.ok = _same(out, new)
    except (subprocess.CalledProcessError, OSError) as exc:
        m.ok, m.note = False, f"failed: {exc}"
    finally:
        for p in (delta, out):
            p.unlink(missing_ok=True)
    return m


def full_zstd_size(path: Path, cache: dict) -> int:
    key = _file_key(path)
    if key not in cache:
        out = subprocess.run(
            ["zstd", "-q", "-19", "--long=27", "-c", str(path)], check=True, capture_output=True
        )
        cache[key] = len(out.stdout)
    return cache[key]


def _file_key(path: Path) -> str:
    st = path.stat()
    return _file_key_cached(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _file_key_cached(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# Peak RSS of one command via getrusage(RUSAGE_CHILDREN) in a wrapper that runs only it
# (the wrapper's own children are just that command, so the maximum is the command's).
_CHILD_JOB = textwrap.dedent(
    """
    import resource, subprocess, sys, time
    start = time.perf_counter()
    subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    print(seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    """
)


def _child_job(*cmd: str) -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD_JOB, *cmd], check=True, capture_output=True, text=True
    )
    seconds, rss = out.stdout.split()[-2:]
    return float(seconds), int(rss)


def run_synthetic(work: Path, layers: int) -> int:
    """Build (once) and measure the synthetic 1.1B pair; 1 when the RSS bar is missed."""
    old, new = work / f"synthetic-{layers}l-old.epk", work / f"synthetic-{layers}l-new.epk"
    if not (old.exists() and new.exists()):
        start = time.perf_counter()
        build_synthetic(old, new, layers)
        print(f"built {old.name} and {new.name} in {time.perf_counter() - start:.0f} s")
    delta, out = work / f"synthetic-{layers}l.epkd", work / f"synthetic-{layers}l-out.epk"
    edgepack = str(Path(sys.executable).with_name("edgepack"))
    try:
        diff_s, diff_rss = _child_job(edgepack, "diff", str(old), str(new), "-o", str(delta))
        patch_s, patch_rss = _child_job(edgepack, "patch", str(old), str(delta), "-o", str(out))
        same = _same(out, new)
        size = delta.stat().st_size
        digest = _file_key(delta)
    finally:
        out.unlink(missing_ok=True)
    config = dict(TINYLLAMA, num_hidden_layers=layers)
    largest = max(math.prod(shape) for _, shape in synthetic_shapes(config)) * 4
    bar = 2 * largest + (512 << 20)
    print(f"synthetic pair, {layers} layers: OLD {_fmt_size(old.stat().st_size)}, "
          f"NEW {_fmt_size(new.stat().st_size)}")
    print(f"  diff:  {diff_s:7.1f} s  peak RSS {_fmt_rss(diff_rss)}")
    print(f"  patch: {patch_s:7.1f} s  peak RSS {_fmt_rss(patch_rss)}  "
          f"{'reproduces NEW' if same else 'DOES NOT reproduce NEW'}")
    print(f"  delta: {_fmt_size(size)} ({100 * size / new.stat().st_size:.2f}% of NEW), "
          f"sha256 {digest}")
    ok = diff_rss < bar
    print(f"  diff peak RSS < 2 x largest tensor as f32 ({_fmt_rss(largest)}) + 512 MiB "
          f"= {_fmt_rss(bar)}: {'PASS' if ok else 'MISS'}")
    return 0 if ok and same else 1


# ---------------------------------------------------------------- driver


def base_package(workdir: Path, encoding: str) -> Path:
    from edgepack.packager.convert import convert
    from edgepack.packager.sample_models import default_cache_dir, fetch_smollm2

    label = {"int4": "int4-g32", "int8": "int8", "int4s8": "int4-g32-s8"}[encoding]
    out = workdir / f"smollm2-{encoding}.epk"
    if not out.exists():
        convert(fetch_smollm2(default_cache_dir()), out, encoding=label)
    return out


def _fmt_size(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 10_000:
        return f"{n} B"
    if n < 10_000_000:
        return f"{n / 1e3:.1f} KB"
    return f"{n / 1e6:.2f} MB"


def _fmt_rss(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def report(encoding: str, scenario: str, full: int, rows: list[Measure]) -> dict:
    ours = next(r for r in rows if r.tool == "ours")
    others = [r for r in rows if r.tool != "ours" and r.size and r.ok]
    best = min(others, key=lambda r: r.size) if others else None
    title = f"[{encoding} {scenario}] {SCENARIOS[scenario]}"
    print(f"\n{title}   full zstd -19 --long=27: {_fmt_size(full)}")
    columns = ("delta", "% full", "ours/x", "create", "c.RSS", "apply", "a.RSS")
    widths = (10, 7, 7, 8, 9, 7, 9)
    print(
        f"  {'tool':8} "
        + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))
        + "  ok"
    )
    for r in rows:
        share = f"{100 * r.size / full:.3f}" if r.size else "-"
        ratio = f"{ours.size / r.size:.2f}" if r.size and ours.size and r is not ours else ""
        cs = f"{r.create_s:.1f}s" if r.create_s is not None else "-"
        aps = f"{r.apply_s:.2f}s" if r.apply_s is not None else "-"
        print(
            f"  {r.tool:8} {_fmt_size(r.size):>10} {share:>7} {ratio:>7} {cs:>8} "
            f"{_fmt_rss(r.create_rss):>9} {aps:>7} {_fmt_rss(r.apply_rss):>9}  "
            f"{'yes' if r.ok else 'NO'} {r.note}"
        )
    verdict = {}
    if best is not None and ours.size:
        verdict["ratio_to_best"] = ours.size / best.size
        verdict["best_tool"] = best.tool
    zstd = next((r for r in rows if r.tool == "zstd" and r.create_s), None)
    if zstd:
        verdict["create_vs_zstd"] = ours.create_s / zstd.create_s
    bsd = next((r for r in rows if r.tool == "bsdiff4" and r.apply_rss), None)
    if bsd:
        verdict["apply_rss_vs_bsdiff4"] = ours.apply_rss / bsd.apply_rss
    return {
        "encoding": encoding,
        "scenario": scenario,
        "full_zstd": full,
        "rows": [asdict(r) for r in rows],
        **verdict,
    }


def check_goals(results: list[dict]) -> list[str]:
    lines = []
    for res in results:
        tag = f"{res['encoding']} {res['scenario']}"
        ours = next(r for r in res["rows"] if r["tool"] == "ours")
        if res["scenario"] in "abABc" and "ratio_to_best" in res:
            ok = res["ratio_to_best"] <= 0.8
            lines.append(
                f"{tag}: size {res['ratio_to_best']:.2f}x smallest tool ({res['best_tool']}) "
                f"[goal <= 0.80] {'PASS' if ok else 'MISS'}"
            )
        if res["scenario"] == "d":
            ok = ours["size"] <= 1024
            lines.append(f"{tag}: {ours['size']} bytes [goal <= 1 KB] {'PASS' if ok else 'MISS'}")
        if "create_vs_zstd" in res:
            ok = res["create_vs_zstd"] <= 1.0
            lines.append(
                f"{tag}: create time {res['create_vs_zstd']:.2f}x zstd --patch-from's "
                f"[goal <= 1] {'PASS' if ok else 'MISS'}"
            )
        if "apply_rss_vs_bsdiff4" in res:
            ok = res["apply_rss_vs_bsdiff4"] < 0.25
            lines.append(
                f"{tag}: apply peak RSS {res['apply_rss_vs_bsdiff4']:.2f}x bsdiff4's "
                f"[goal < 0.25] {'PASS' if ok else 'MISS'}"
            )
        if not all(r["ok"] for r in res["rows"] if r["size"]):
            lines.append(f"{tag}: some tool did not reproduce NEW exactly")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="skip bsdiff4 and xdelta3")
    ap.add_argument("--encodings", default="int4,int8")
    ap.add_argument("--scenarios", default="abABcde")
    ap.add_argument(
        "--workdir",
        default=Path(tempfile.gettempdir()) / "edgepack-bench-delta",
        type=Path,
        help="packages, deltas and cached tool results (default: %(default)s)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--no-cache",
        action="store_true",
        help="re-measure the other tools (by default their results are cached in the workdir, "
        "keyed by the SHA-256 of both packages; ours is always measured)",
    )
    ap.add_argument(
        "--synthetic-1b",
        action="store_true",
        help="measure edgepack diff/patch on a random pair with a 1.1B Llama's shapes",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=TINYLLAMA["num_hidden_layers"],
        help="layers of the synthetic pair (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    if args.synthetic_1b:
        return run_synthetic(work, args.layers)
    cache_path = work / "full-zstd.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    tools_path = work / "tool-results.json"
    tool_cache = json.loads(tools_path.read_text()) if tools_path.exists() else {}

    tools = ["ours", "zstd"]
    if not args.quick:
        tools += ["bsdiff4", "xdelta3"]
    available = []
    for tool in tools:
        if tool == "bsdiff4":
            try:
                import bsdiff4  # noqa: F401
            except ImportError:
                print("note: bsdiff4 not installed (pip install bsdiff4): skipped")
                continue
        elif tool != "ours" and shutil.which(tool) is None:
            print(f"note: {tool} not found (apt-get install {tool}): skipped")
            continue
        available.append(tool)
    if shutil.which("zstd") is None:
        print("note: zstd CLI missing: no full-size reference, ratios to it are omitted")

    results = []
    for encoding in args.encodings.split(","):
        old = base_package(work, encoding)
        for scenario in args.scenarios:
            new = _scenario_file(work, encoding, scenario)
            if not new.exists():
                build_scenario(old, new, scenario)
            full = full_zstd_size(new, cache) if shutil.which("zstd") else new.stat().st_size
            cache_path.write_text(json.dumps(cache))
            rows = []
            for tool in available:
                key = f"{tool}:{_file_key(old)}:{_file_key(new)}"
                if tool != "ours" and key in tool_cache and not args.no_cache:
                    rows.append(Measure(**tool_cache[key]))
                    continue
                m = measure_tool(tool, old, new, work)
                if tool != "ours" and m.ok:
                    tool_cache[key] = asdict(m)
                    tools_path.write_text(json.dumps(tool_cache, indent=1))
                rows.append(m)
            results.append(report(encoding, scenario, full, rows))
            sys.stdout.flush()
    print("\nGoals")
    for line in check_goals(results):
        print("  " + line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
