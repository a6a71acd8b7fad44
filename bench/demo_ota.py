"""`make demo`, the whole delivery story on loopback (not a benchmark).

From a signed SmolLM2 package (built by `make demo` before this runs): publish it to a
local release store, start `edgepack serve`, install it through the device client
(`edgepack update`) into a slot directory, generate text from the active slot, publish
an update (a LoRA-merged fine-tune of q/v/o in every layer, as bench/delta.py's
scenario ``a`` makes it, re-signed), update through a delta, generate again, and print
the bytes each update shipped beside the full package's size. It stops the server.

    .venv/bin/python bench/demo_ota.py --package out/smollm2-int4.epk --key out/release.key
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # pkgfactory.replace_header (re-signing)
sys.path.insert(0, str(ROOT / "bench"))

from delta import LORA_TARGETS, _choice_of, lora_update, write_variant  # noqa: E402
from pkgfactory import replace_header  # noqa: E402

from edgepack.format import Package  # noqa: E402
from edgepack.format.signing import load_private_key  # noqa: E402

EDGEPACK = [sys.executable, "-m", "edgepack.cli"]
PROMPT = "The capital of France is"


def edgepack(*args: str) -> str:
    print("$ edgepack " + shlex.join(args), flush=True)
    out = subprocess.run([*EDGEPACK, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"edgepack {args[0]} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def fine_tune(v1: Path, v2: Path, key: Path, version: str) -> None:
    """v2 = v1 with a rank-16 update merged into q/v/o of every layer, signed."""
    rng = np.random.default_rng(5)

    def modify(name, entry, pkg):
        if not any(name.endswith(f".{t}.weight") for t in LORA_TARGETS):
            return None
        w = pkg.dequantize(name)
        return w + lora_update(w, rng), _choice_of(entry)

    write_variant(v1, v2, modify=modify, version=version,
                  provenance_update={"finetune": "lora-demo"})
    with Package.open(v2) as pkg:
        header = pkg.header
    v2.write_bytes(replace_header(v2.read_bytes(), header, sign_with=load_private_key(key)))


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    sys.exit("edgepack serve did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", type=Path, required=True, help="signed v1 package")
    ap.add_argument("--key", type=Path, required=True, help="its signing key (NAME.key)")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    work = args.package.parent / "ota-demo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    store, keys, slots = work / "store", work / "repo-keys", work / "device"
    pub = args.key.with_suffix(".pub")
    v1 = args.package
    model = "smollm2"  # the name devices ask for (the package's own has spaces)
    with Package.open(v1) as pkg:
        version = pkg.header.identity.version
    major, minor, _ = (int(x) for x in version.split("-")[0].split(".")[:3])
    v2 = work / "smollm2-finetune.epk"
    v2_version = f"{major}.{minor + 1}.0"
    print(f"== fine-tune {model} {version} -> {v2_version} (LoRA q/v/o merged)", flush=True)
    fine_tune(v1, v2, args.key, v2_version)

    print("== release store and server", flush=True)
    edgepack("repo", "init", "--store", str(store), "--keys-dir", str(keys),
             "--package-key", str(pub))
    edgepack("publish", str(v1), "--store", str(store), "--keys-dir", str(keys),
             "--channel", "stable", "--model", model)
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [*EDGEPACK, "serve", "--store", str(store), "--port", str(args.port),
         "--refresh-seconds", "0.5"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        wait_ready(url, server)
        update = ["update", "--server", url, "--slot-dir", str(slots), "--device-id",
                  "demo-device", "--channel", "stable", "--model", model,
                  "--trusted-key", str(pub), "--json"]
        trusted_root = ["--trusted-root", str(store / "metadata" / "1.root.json")]
        for step in ("install", "update"):
            if step == "update":
                edgepack("publish", str(v2), "--store", str(store), "--keys-dir", str(keys),
                         "--channel", "stable", "--model", model)
                time.sleep(1.5)  # the server re-reads the metadata every 0.5 s
            print(f"== device: {step}", flush=True)
            result = json.loads(edgepack(*update, *(trusted_root if step == "install" else [])))
            print(json.dumps(result, indent=1))
            if result["result"] != "updated":
                sys.exit(f"the {step} did not update: {result}")
            rows.append((step, result))
            journal = json.loads((slots / "journal.json").read_text())
            active = slots / journal["active"] / "model.epk"
            print(edgepack("run", str(active), "-p", PROMPT, "--max-tokens", "16").strip())
    finally:
        server.terminate()
        server.wait(20)
    print("\n== bytes shipped per update")
    print(f"{'step':8} {'plan':6} {'version':10} {'downloaded':>12} {'full package':>13}")
    for step, r in rows:
        print(f"{step:8} {r['plan']:6} {r['version']:10} {r['bytes_downloaded']:>12,} "
              f"{r['full_bytes']:>13,}")


if __name__ == "__main__":
    main()
