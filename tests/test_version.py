"""``edgepack.__version__``: the installed distribution's version (one source: pyproject),
the same in ``edgepack --version`` and the runtime's capabilities, and free to import."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import edgepack
from edgepack.cli import main
from edgepack.runtime_shim import runtime_version

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_version_is_pyprojects():
    (declared,) = re.findall(r'(?m)^version = "([^"]+)"$', PYPROJECT.read_text())
    assert edgepack.__version__ == declared == metadata.version("edgepack")


def test_cli_and_runtime_report_the_same_version(capsys):
    try:
        main(["--version"])
    except SystemExit as stop:  # click's ctx.exit outside standalone mode
        assert stop.code in (0, None)
    assert capsys.readouterr().out == f"edgepack, version {edgepack.__version__}\n"
    assert runtime_version() == edgepack.__version__


def test_subpackages_import_and_the_runtime_pays_nothing_for_the_top_package():
    code = (
        "import sys, edgepack.runtime_shim, edgepack.format;"
        "assert 'importlib.metadata' not in sys.modules, 'runtime import read metadata';"
        "assert 'edgepack.packager' not in sys.modules;"
        "import edgepack; print(edgepack.__version__, edgepack.format.Package.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [edgepack.__version__, "Package"]
