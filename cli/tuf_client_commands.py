"""``edgepack tuf-client``: the TUF conformance suite's client protocol, on the update
client's own code paths (:mod:`edgepack.runtime_shim.update.trust` and ``.download``).
Exit 0 on success, 1 on any failure (listed in :data:`edgepack.cli.app.COMMAND_MODULES`).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from urllib.parse import quote

import click

from .output import record


@click.group("tuf-client")
@click.option(
    "--metadata-dir", type=click.Path(file_okay=False), help="Trusted metadata (required)."
)
@click.option("--metadata-url", default=None, help="Base URL of the TUF metadata.")
@click.option("--target-name", "target_names", multiple=True, help="Target path; repeatable.")
@click.option("--target-base-url", default=None, help="Base URL of the targets.")
@click.option("--target-dir", default=None, type=click.Path(file_okay=False))
@click.pass_context
def tuf_client(ctx: click.Context, **options: object) -> None:
    """TUF conformance client: init TRUSTED_ROOT | refresh | download."""
    ctx.obj = options


def _metadata_dir(obj: dict) -> Path:
    if not obj["metadata_dir"]:
        raise click.UsageError("--metadata-dir is required")
    return Path(obj["metadata_dir"])


@tuf_client.command()
@click.argument("trusted_root", type=click.Path(exists=True, dir_okay=False))
@click.pass_obj
def init(obj: dict, trusted_root: str) -> int:
    """Trust TRUSTED_ROOT (copied as root.json; no request is made)."""
    meta = _metadata_dir(obj)
    meta.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(trusted_root, meta / "root.json")
    record(root=str(meta / "root.json"))
    return 0


@tuf_client.command()
@click.pass_obj
def refresh(obj: dict) -> int:
    """Update the top-level metadata (stored as root.json, timestamp.json, ...)."""
    return _run(lambda: (_refresh(obj), _record_metadata(obj)))


@tuf_client.command()
@click.pass_obj
def download(obj: dict) -> int:
    """Refresh, then fetch each --target-name into --target-dir, in order (skipping
    those already there with matching hashes)."""
    return _run(lambda: (_download(obj), _record_metadata(obj)))


def _record_metadata(obj: dict) -> None:
    """The ``--json`` facts: which metadata files are trusted now."""
    record(metadata=sorted(p.name for p in _metadata_dir(obj).glob("*.json")))


def _refresh(obj: dict):
    from edgepack.runtime_shim.update.config import UpdateConfig
    from edgepack.runtime_shim.update.fetcher import RangeFetcher
    from edgepack.runtime_shim.update.trust import refresh as tuf_refresh

    if not obj["metadata_url"]:
        raise click.UsageError("--metadata-url is required")
    config = UpdateConfig()
    fetcher = RangeFetcher(config)
    tuf = tuf_refresh(_metadata_dir(obj), obj["metadata_url"].rstrip("/") + "/",
                      obj["target_base_url"], fetcher, config, None)
    return tuf, fetcher, config


def _download(obj: dict) -> None:
    from edgepack.runtime_shim.update.download import DownloadTarget, download_target
    from edgepack.runtime_shim.update.errors import UnsafeTargetError
    from edgepack.runtime_shim.update.trust import target_url, targetinfo

    if not obj["target_base_url"] or not obj["target_dir"]:
        raise click.UsageError("--target-base-url and --target-dir are required")
    tuf, fetcher, config = _refresh(obj)
    target_dir = Path(obj["target_dir"])
    target_dir.mkdir(parents=True, exist_ok=True)
    targets: list[str] = []  # in --target-name order, fetched or already there
    for name in obj["target_names"]:
        info = targetinfo(tuf, name)
        if info is None:
            raise UnsafeTargetError(f"target {name} is not in the signed metadata")
        dest = target_dir / quote(info.path, "")
        targets.append(str(dest))
        record(targets=targets)
        if dest.exists() and _matches(info, dest):
            continue
        url = target_url(tuf, info, obj["target_base_url"])
        download_target(fetcher, DownloadTarget(url, info.length, info.hashes.get("sha256")),
                        dest, config)
        if not _matches(info, dest):
            dest.unlink()
            raise UnsafeTargetError(f"target {name}: length or hashes do not match")


def _matches(info, path: Path) -> bool:
    from tuf.api.exceptions import LengthOrHashMismatchError

    with open(path, "rb") as f:
        try:
            info.verify_length_and_hashes(f)
        except LengthOrHashMismatchError:
            return False
    return True


def _run(step) -> int:
    try:
        step()
    except click.UsageError:
        raise
    except Exception as e:
        message = str(e).splitlines()[0] if str(e) else ""
        record(error={"type": type(e).__name__, "message": message})
        print(f"error: {type(e).__name__}: {message}", file=sys.stderr)
        return 1
    return 0


COMMANDS = [tuf_client]
