"""The CLI is assembled explicitly: command modules list their commands and never import
the group; options several commands share are declared once and agree everywhere."""

from __future__ import annotations

import ast
from importlib import import_module
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import edgepack.cli
from edgepack.cli.app import COMMAND_MODULES, make_cli

CLI_DIR = Path(edgepack.cli.__file__).parent
SHARED = (
    "out", "sign_keys", "trusted_keys", "threshold", "kernels", "threads", "as_json", "quiet"
)


def _walk(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    found = []
    for name, cmd in group.commands.items():
        found.append((f"{prefix}{name}", cmd))
        if isinstance(cmd, click.Group):
            found += _walk(cmd, f"{prefix}{name} ")
    return found


def test_group_holds_exactly_the_listed_commands() -> None:
    listed = [c for m in COMMAND_MODULES for c in import_module(f"edgepack.cli.{m}").COMMANDS]
    group = make_cli()
    assert sorted(group.commands.values(), key=id) == sorted(listed, key=id)
    assert len({c.name for c in listed}) == len(listed)


def test_no_command_module_imports_the_group() -> None:
    for path in CLI_DIR.glob("*.py"):
        if path.name in ("__init__.py", "__main__.py", "app.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("app", "edgepack.cli.app"), path.name
                assert not {a.name for a in node.names} & {"app", "cli", "make_cli"}, path.name
            if isinstance(node, ast.Name):
                assert node.id not in ("cli", "make_cli"), f"{path.name} uses {node.id}"


def test_shared_options_agree_across_commands() -> None:
    seen: dict[str, tuple] = {}
    for where, cmd in _walk(make_cli()):
        for p in cmd.params:
            if p.name not in SHARED or not isinstance(p, click.Option):
                continue
            shape = (tuple(p.opts), p.type.to_info_dict(), p.multiple, p.required, p.default)
            assert seen.setdefault(p.name, shape) == shape, f"{where} {p.name}"
    assert set(seen) == set(SHARED)


@pytest.mark.parametrize("command", [name for name, _ in _walk(make_cli())])
def test_every_command_has_help(command: str) -> None:
    result = CliRunner().invoke(make_cli(), [*command.split(), "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
