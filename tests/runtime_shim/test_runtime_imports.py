"""The device SDK stays small: importing the runtime shim pulls in none of the build or
server stack (checked in a fresh interpreter, where nothing else is loaded yet)."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = [
    "edgepack.packager",
    "edgepack.server",
    "edgepack.cli",
    "boto3",
    "click",
    "fastapi",
    "uvicorn",
    "safetensors",
    "gguf",
    "torch",
    "transformers",
    "tokenizers",
    "rich",
]


def test_runtime_shim_imports_nothing_heavy() -> None:
    code = (
        "import sys, json, edgepack.runtime_shim as rt; rt.runtime_capabilities();"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    loaded = set(json.loads(out.stdout))
    assert "edgepack.format" in loaded  # the check itself is live
    leaked = [m for m in FORBIDDEN if m in loaded or any(x.startswith(m + ".") for x in loaded)]
    assert leaked == []
