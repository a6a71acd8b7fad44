"""edgepack.runtime_shim: what ships inside an app.

It depends only on edgepack.format, numpy and the optional native kernels; never on the
packager, the server, click, boto3, safetensors or gguf (tests/test_runtime_imports.py).
"""

from .capabilities import runtime_capabilities, runtime_version

__all__ = ["runtime_capabilities", "runtime_version"]
