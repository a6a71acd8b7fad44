"""Quality of `edgepack build` on SmolLM2-135M-Instruct beside llama.cpp's figures.

Reference: f32 dequantized from the shipped Q4_1 GGUF (``edgepack convert --encoding f32``).
Eval text: ``pydoc_data.topics`` sorted keys ``[40:]``, ctx 512, first 40 chunks, the
llama.cpp ``llama-perplexity`` protocol (:mod:`edgepack.packager.evaluate`). Prints, for
every package: file bytes, bits per weight, PPL, mean KL and top-1 agreement against the
reference, then the comparisons the issue asks for:

* mixed search at llama.cpp's IQ4_NL (77,571,360 B) and Q3_K_S (74,046,240 B) sizes, and
  at 3.5 bits per weight (a size llama.cpp cannot make for this model);
* mixed search vs uniform int4 RTN at the same file size;
* GPTQ vs RTN at the same encoding (uniform int4-g32 and int3-g32);
* build time and peak RSS of an RTN build and of the full search with GPTQ.

Builds run as ``edgepack build`` subprocesses (their own time and peak RSS); packages and
the reference's log-probs are cached in ``--out`` so a rerun only does what is missing.

    python bench/quality.py [--out DIR] [--chunks 40] [--only mix77,rtn] [--kv float]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

LLAMA_CPP = [  # (type, file bytes, bits/weight, PPL), measured with build 4748
    ("F32 (reference)", 539_845_696, 32.1, 10.969),
    ("Q8_0", 144_811_072, 8.61, 11.034),
    ("Q4_1 (the source grid)", 98_362_432, 5.85, 11.005),
    ("Q4_0 (embedding Q8_0)", 91_726_912, 5.46, 13.310),
    ("Q2_K (mostly IQ4_NL fallbacks)", 88_201_792, 5.25, 14.998),
    ("Q4_0 pure (embedding 4-bit too)", 77_571_136, 4.61, 14.428),
    ("Q4_0 pure + imatrix", 77_737_248, 4.62, 13.023),
    ("IQ4_NL pure + imatrix", 77_571_360, 4.61, 12.915),
    ("Q3_K_S pure + imatrix", 74_046_240, 4.40, 13.840),
]
PARAMS = 134_515_008  # SmolLM2-135M, every tensor


def _recipe(out: Path, name: str, body: str) -> Path:
    p = out / f"{name}.toml"
    p.write_text(body)
    return p


RTN_INT4 = """
[quantize]
encodings = ["int4-g32"]
algorithm = "rtn"
scale_search = false
"""
GPTQ_INT4 = """
[quantize]
encodings = ["int4-g32"]
algorithm = "gptq"
"""
RTN_INT3 = """
[quantize]
encodings = ["int3-g32"]
algorithm = "rtn"
scale_search = false
"""
GPTQ_INT3 = """
[quantize]
encodings = ["int3-g32"]
algorithm = "gptq"
"""


def _run(cmd: list[str]) -> str:
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stdout + res.stderr)
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return res.stdout


def _build(gguf: Path, out: Path, name: str, args: list[str], meta: dict) -> tuple[Path, dict]:
    path = out / f"{name}.epk"
    info_path = out / f"{name}.build.json"
    if path.exists() and info_path.exists():
        return path, json.loads(info_path.read_text())
    t0 = time.perf_counter()
    text = _run(["edgepack", "build", str(gguf), "-o", str(path), *args])
    info = {"wall_s": time.perf_counter() - t0, **meta}
    m = re.search(r"peak RSS (\d+) MiB", text)
    info["peak_rss_mib"] = int(m[1]) if m else None
    m = re.search(r"^time ([\d.]+)s", text, re.M)
    info["build_s"] = float(m[1]) if m else None
    info["summary"] = text
    info_path.write_text(json.dumps(info, indent=1))
    return path, info


def _eval(pkg: Path, ref: Path, out: Path, chunks: int, kv: str) -> dict:
    cache = pkg.with_suffix(f".eval{chunks}-{kv}.json")
    if cache.exists():
        return json.loads(cache.read_text())
    from edgepack.packager.evaluate import evaluate

    print(f"eval {pkg.name} ...", file=sys.stderr, flush=True)
    res = evaluate(
        pkg,
        chunks=chunks,
        ref=None if pkg == ref else ref,
        kv=kv,
        ref_cache=out / "ref-logprobs",
        on_chunk=lambda i, n, p: print(f"\r  [{i}/{n}] PPL {p:.4f}", end="", file=sys.stderr),
    )
    print(file=sys.stderr)
    doc = res.to_json()
    cache.write_text(json.dumps(doc))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="work folder (default: cache/bench-quality)")
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--kv", default="float", choices=["float", "int8"])
    ap.add_argument("--only", default="", help="comma-separated subset of the runs")
    args = ap.parse_args(argv)

    from edgepack.packager.convert import convert
    from edgepack.packager.sample_models import default_cache_dir, fetch_smollm2

    cache = Path(default_cache_dir())
    gguf = fetch_smollm2(cache)
    out = Path(args.out) if args.out else cache / "bench-quality"
    out.mkdir(parents=True, exist_ok=True)
    ref = out / "ref-f32.epk"
    if not ref.exists():
        convert(gguf, ref, encoding="f32")
    rtn_pure = out / "rtn-int4-g32-pure.epk"
    if not rtn_pure.exists():
        convert(gguf, rtn_pure, encoding="int4-g32", embedding_encoding="int4-g32")
    uniform_size = rtn_pure.stat().st_size

    runs = {  # name -> (build args, what it shows)
        "mix77": (["--target-size", "77571360"], "mixed @ IQ4_NL size"),
        "mix74": (["--target-size", "74046240"], "mixed @ Q3_K_S size"),
        "mix35": (["--target-bpw", "3.5"], "mixed @ 3.5 bpw"),
        "mix-uniform": (["--target-size", str(uniform_size)], "mixed @ uniform int4 size"),
        "rtn4": (["--recipe", str(_recipe(out, "rtn4", RTN_INT4))], "RTN int4-g32 (build)"),
        "gptq4": (["--recipe", str(_recipe(out, "gptq4", GPTQ_INT4))], "GPTQ int4-g32"),
        "rtn3": (["--recipe", str(_recipe(out, "rtn3", RTN_INT3))], "RTN int3-g32"),
        "gptq3": (["--recipe", str(_recipe(out, "gptq3", GPTQ_INT3))], "GPTQ int3-g32"),
    }
    only = {x for x in args.only.split(",") if x}
    built: dict[str, tuple[Path, dict]] = {}
    for name, (bargs, what) in runs.items():
        if only and name not in only:
            continue
        built[name] = _build(
            gguf, out, name, [*bargs, "--no-report"] if "rtn" in name else bargs, {"what": what}
        )
    evals = {"ref": _eval(ref, ref, out, args.chunks, args.kv)}
    evals["rtn-pure"] = _eval(rtn_pure, ref, out, args.chunks, args.kv)
    for name, (path, _) in built.items():
        evals[name] = _eval(path, ref, out, args.chunks, args.kv)

    print(f"\nSmolLM2-135M-Instruct, {args.chunks} chunks of 512, KV cache {args.kv}\n")
    print("llama.cpp (build 4748, from the issue):")
    print(f"  {'type':<34} {'bytes':>13} {'bpw':>6} {'PPL':>8}")
    for t, b, bpw, ppl in LLAMA_CPP:
        print(f"  {t:<34} {b:>13,} {bpw:>6.2f} {ppl:>8.3f}")
    print("\nedgepack:")
    print(f"  {'package':<28} {'bytes':>13} {'bpw':>6} {'PPL':>8} {'KL':>9} {'top-1':>7}")
    rows = [("ref", ref, "f32 reference"), ("rtn-pure", rtn_pure, "convert int4-g32 (pure)")]
    rows += [(n, p, info["what"]) for n, (p, info) in built.items()]
    for name, path, what in rows:
        e = evals[name]
        size = path.stat().st_size
        kl = f"{e['kl_mean']:.5f}" if e.get("kl_mean") is not None else "-"
        top1 = f"{100 * e['top1']:.2f}%" if e.get("top1") is not None else "-"
        print(
            f"  {what:<28} {size:>13,} {size * 8 / PARAMS:>6.3f} {e['ppl']:>8.3f} {kl:>9} {top1:>7}"
        )
    print("\nbars:")

    def bar(name: str, limit: float, target: int | None, label: str) -> None:
        if name not in evals:
            return
        size = built[name][0].stat().st_size
        ok = evals[name]["ppl"] <= limit and (target is None or abs(size - target) <= 0.01 * target)
        where = f"{size:,} B" + (f" ({100 * size / target:.2f} % of {target:,})" if target else "")
        verdict = "OK" if ok else "MISS"
        print(f"  {label}: PPL {evals[name]['ppl']:.3f} vs {limit} at {where}: {verdict}")

    bar("mix77", 12.915, 77_571_360, "IQ4_NL size")
    bar("mix74", 13.840, 74_046_240, "Q3_K_S size")
    bar("mix35", 14.998, None, "3.5 bpw (below Q2_K's PPL)")
    if "mix-uniform" in evals:
        print(
            f"  mixed vs uniform int4 RTN at {uniform_size:,} B: PPL "
            f"{evals['mix-uniform']['ppl']:.3f} vs {evals['rtn-pure']['ppl']:.3f}"
        )
    for bits in ("4", "3"):
        r, g = f"rtn{bits}", f"gptq{bits}"
        if r in evals and g in evals:
            print(
                f"  GPTQ vs RTN, int{bits}-g32: PPL {evals[g]['ppl']:.3f} vs {evals[r]['ppl']:.3f}"
                f", KL {evals[g]['kl_mean']:.4f} vs {evals[r]['kl_mean']:.4f}"
            )
    print("\nbuild time and peak RSS (f32 model 540 MB; bars: RTN < 30 s, search < 300 s,")
    print("RSS < 3x f32 = 1540 MiB):")
    for _, info in built.values():
        print(
            f"  {info['what']:<28} {info.get('build_s') or 0:>7.1f} s (wall {info['wall_s']:.1f} s)"
            f"  peak RSS {info.get('peak_rss_mib')} MiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
