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
    "tuf",
    "urllib3",
    "securesystemslib",
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


def test_update_client_loads_no_server_code() -> None:
    code = (
        "import sys, json, edgepack.runtime_shim as rt, edgepack.runtime_shim.update as up;"
        "from edgepack.runtime_shim.update import trust, fetcher, updater;"
        "assert rt.open_slot is up.open_slot; print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    loaded = set(json.loads(out.stdout))
    assert "tuf.ngclient" in loaded  # the check itself is live
    # (securesystemslib itself probes for boto3, for its AWS KMS signer: not ours to stop)
    server = ["edgepack.packager", "edgepack.server", "edgepack.cli", "click", "fastapi", "uvicorn"]
    assert [m for m in server if m in loaded or any(x.startswith(m + ".") for x in loaded)] == []


# Loaded by a run only if something asks for them: OpenSSL (+3.9 MiB resident; the
# digests of an unverified open are CPython's own), importlib.metadata (+3.0 MiB; the
# version comes from the generated edgepack._version) and subprocess (ctypes.util).
NOT_ON_THE_RUN_PATH = ["hashlib", "_hashlib", "importlib.metadata", "subprocess"]


def test_an_unverified_run_loads_no_openssl_metadata_or_subprocess(tmp_path_factory) -> None:
    from runtime_fixtures import tiny_package

    pkg = tiny_package(tmp_path_factory, "int8")
    code = (
        "import sys, json, edgepack.runtime_shim as rt\n"
        f"with rt.open({str(pkg)!r}, verify='none') as m:\n"
        "    assert len(list(m.session().generate([1, 2, 3], 4, lookup=True))) == 4\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    loaded = set(json.loads(out.stdout))
    assert "edgepack.runtime_shim.kv_cache" in loaded  # the check itself is live
    assert [m for m in NOT_ON_THE_RUN_PATH if m in loaded] == []
