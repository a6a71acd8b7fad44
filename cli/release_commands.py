"""Release commands: ``repo init|rotate-key|renew-root|refresh|verify``, ``publish``,
``releases``, ``promote``.

Keys live in ``--keys-dir`` (default ``./edgepack-keys``, or ``$EDGEPACK_KEYS_DIR``),
never in the store. ``--store`` may come from ``$EDGEPACK_STORE``; S3 endpoints and
credentials from the usual AWS environment or ``--endpoint-url``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import click

from .exit_codes import EXIT_CORRUPT, EXIT_OK
from .options import endpoint_option, json_option, store_option, trusted_key_option
from .output import log_to_stderr, record
from .progress import progress_bars

_keys_option = click.option(
    "--keys-dir",
    default="edgepack-keys",
    show_default=True,
    envvar="EDGEPACK_KEYS_DIR",
    type=click.Path(file_okay=False),
    help="Directory of the repository's signing keys ($EDGEPACK_KEYS_DIR); never the store.",
)
_verbose_option = click.option(
    "-v", "--verbose", is_flag=True, help="Log every step (uploads, metadata writes) to stderr."
)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage().replace("\n", " ")
        return msg if record.levelno < logging.WARNING else f"warning: {msg}"


def _setup_logging(verbose: bool) -> None:
    """Log lines of the release code to (the current) stderr: warnings always,
    every step with --verbose."""
    log_to_stderr(_Formatter(), logging.INFO if verbose else logging.WARNING)


def _open(store_url: str, endpoint_url: str | None, keys_dir: str | None, *, create: bool = False):
    from edgepack.server.releases.keys import KeyRing
    from edgepack.server.releases.repository import ReleaseRepository
    from edgepack.server.store import open_store

    store = open_store(store_url, endpoint_url=endpoint_url, create=create)
    if keys_dir is not None:
        _check_keys_outside_store(store, keys_dir)
    return ReleaseRepository(store, KeyRing(keys_dir) if keys_dir is not None else None)


def _check_keys_outside_store(store: Any, keys_dir: str) -> None:
    from pathlib import Path

    root = getattr(store, "root", None)
    if root is None:
        return
    keys = Path(keys_dir).absolute()
    if keys == root or root in keys.parents:
        raise click.BadParameter(
            "the keys directory must not be inside the store (it would be published)",
            param_hint="--keys-dir",
        )


def _percent(value: float | None) -> float | None:
    if value is not None and not 0 <= value <= 100:
        raise click.BadParameter("must be between 0 and 100", param_hint="--rollout")
    return value


def _fmt_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def _fmt_pct(p: float) -> str:
    return f"{p:g}%"


def _versions(v: Any) -> str:
    return ", ".join(f"{role} v{v[role]}" for role in ("targets", "snapshot", "timestamp"))


# ============================================================================ repo


@click.group()
def repo() -> None:
    """Create and maintain a release repository (TUF metadata and keys)."""


@repo.command("init")
@store_option
@endpoint_option
@_keys_option
@click.option(
    "--root-keys",
    default=1,
    show_default=True,
    type=click.IntRange(1, 16),
    help="Number of root keys to create.",
)
@click.option(
    "--root-threshold",
    default=1,
    show_default=True,
    type=click.IntRange(1, 16),
    help="Root signatures required for a new root.",
)
@click.option(
    "--package-key",
    "package_keys",
    multiple=True,
    type=click.Path(exists=True),
    help="Require packages signed by this public key (NAME.pub); repeatable.",
)
@click.option(
    "--package-threshold",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Signatures from distinct --package-key keys a package needs.",
)
@click.option(
    "--deltas",
    "delta_count",
    default=3,
    show_default=True,
    type=click.IntRange(0, 64),
    help="Deltas to precompute on publish, from the last N releases of the channel.",
)
@click.option(
    "--expires",
    "expires",
    multiple=True,
    metavar="ROLE=DAYS",
    help="Metadata lifetime, e.g. timestamp=1 (defaults: root 365, targets 90, "
    "snapshot 30, timestamp 7).",
)
@_verbose_option
def repo_init(
    store_url: str,
    endpoint_url: str | None,
    keys_dir: str,
    root_keys: int,
    root_threshold: int,
    package_keys: tuple[str, ...],
    package_threshold: int,
    delta_count: int,
    expires: tuple[str, ...],
    verbose: bool,
) -> int:
    """Create keys for the four TUF roles and version 1 of the metadata."""
    from edgepack.format import key_id, load_public_key
    from edgepack.server.releases.metadata import RepoPolicy

    _setup_logging(verbose)
    if root_threshold > root_keys:
        raise click.BadParameter("cannot exceed --root-keys", param_hint="--root-threshold")
    if package_keys and package_threshold > len(package_keys):
        raise click.BadParameter(
            "exceeds the number of --package-key", param_hint="--package-threshold"
        )
    expiry = dict(RepoPolicy().expiry_days)
    for item in expires:
        role, _, days = item.partition("=")
        if role not in expiry or not days.isdigit() or int(days) < 1:
            raise click.BadParameter(
                f"{item!r} (ROLE=DAYS, ROLE one of {', '.join(expiry)})", param_hint="--expires"
            )
        expiry[role] = int(days)
    pkeys = {}
    for path in package_keys:
        key = load_public_key(path)
        with open(path) as f:
            pkeys[key_id(key).hex()] = f.read()
    policy = RepoPolicy(
        package_keys=pkeys,
        package_threshold=package_threshold,
        delta_count=delta_count,
        expiry_days=expiry,
    )
    rr = _open(store_url, endpoint_url, keys_dir, create=True)
    state = rr.init(root_keys=root_keys, root_threshold=root_threshold, policy=policy)
    record(
        store=rr.store.url,
        root_version=state.root.version,
        root_keys=root_keys,
        root_threshold=root_threshold,
        keys_dir=keys_dir,
        package_keys=sorted(pkeys),
        package_threshold=package_threshold if pkeys else None,
    )
    signed = (
        f"packages must be signed by {package_threshold} of {len(pkeys)} key(s)"
        if pkeys
        else "package signatures not required"
    )
    click.echo(
        f"initialised {rr.store.url}: root v{state.root.version} "
        f"({root_threshold} of {root_keys} root key(s)), keys in {keys_dir}; {signed}"
    )
    return EXIT_OK


@repo.command("rotate-key")
@click.argument("role", type=click.Choice(["root", "targets", "snapshot", "timestamp"]))
@store_option
@endpoint_option
@_keys_option
@_verbose_option
def repo_rotate_key(
    role: str, store_url: str, endpoint_url: str | None, keys_dir: str, verbose: bool
) -> int:
    """Replace ROLE's keys with fresh ones (a new root version, signed by old and new)."""
    _setup_logging(verbose)
    rr = _open(store_url, endpoint_url, keys_dir)
    root = rr.rotate_key(role)
    keyids = list(root.roles[role].keyids)
    ids = ", ".join(k[:16] for k in keyids)
    record(store=rr.store.url, role=role, root_version=root.version, key_ids=keyids)
    click.echo(f"rotated {role} key(s) in {rr.store.url}: root v{root.version}, new key(s) {ids}")
    return EXIT_OK


@repo.command("renew-root")
@store_option
@endpoint_option
@_keys_option
@_verbose_option
def repo_renew_root(store_url: str, endpoint_url: str | None, keys_dir: str, verbose: bool) -> int:
    """Re-sign the root (same keys) with a new expiry: needs the root keys."""
    from edgepack.server.releases.metadata import format_time

    _setup_logging(verbose)
    rr = _open(store_url, endpoint_url, keys_dir)
    root = rr.renew_root()
    expires = format_time(root.expires)
    record(store=rr.store.url, root_version=root.version, expires=expires)
    click.echo(f"renewed the root of {rr.store.url}: v{root.version}, expires {expires}")
    return EXIT_OK


@repo.command("refresh")
@store_option
@endpoint_option
@_keys_option
@click.option("--force", is_flag=True, help="Re-sign targets and snapshot too.")
@_verbose_option
def repo_refresh(
    store_url: str, endpoint_url: str | None, keys_dir: str, force: bool, verbose: bool
) -> int:
    """Re-sign the timestamp (and what is near expiry): run it from cron. The root is
    renewed by `repo renew-root` (its keys may be offline)."""
    _setup_logging(verbose)
    rr = _open(store_url, endpoint_url, keys_dir)
    versions = rr.refresh(force=force)
    record(store=rr.store.url, versions=dict(versions))
    click.echo(f"refreshed {rr.store.url}: {_versions(versions)}")
    return EXIT_OK


@repo.command("verify")
@store_option
@endpoint_option
@_keys_option
@click.option("--deep", is_flag=True, help="Also hash every object (reads all bytes).")
@_verbose_option
def repo_verify(
    store_url: str, endpoint_url: str | None, keys_dir: str, deep: bool, verbose: bool
) -> int:
    """Check signatures, expiry, root.json, that every target's bytes are in the store
    and, against the versions recorded in --keys-dir (when it exists), rollbacks."""
    from pathlib import Path

    _setup_logging(verbose)
    rr = _open(store_url, endpoint_url, keys_dir if Path(keys_dir).is_dir() else None)
    checked = rr.keys is not None and rr.has_trusted_state()
    problems = rr.verify(deep=deep)
    record(store=rr.store.url, problems=list(problems), rollback_checked=checked)
    if problems:
        record(error={"type": "RepositoryProblems", "message": "; ".join(problems)})
        click.echo(
            f"{len(problems)} problem(s) in {rr.store.url}: " + "; ".join(problems), err=True
        )
        return EXIT_CORRUPT
    rollback = (
        f"no rollback below the versions recorded in {keys_dir}"
        if checked
        else f"rollback NOT checked (no state recorded in {keys_dir} yet; versions now recorded)"
        if rr.keys is not None
        else f"rollback NOT checked (no keys directory {keys_dir} with recorded versions)"
    )
    click.echo(f"OK {rr.store.url}: metadata verifies, every target is present; {rollback}")
    return EXIT_OK


@repo.command("gc")
@store_option
@endpoint_option
@click.option("--delete", is_flag=True, help="Delete what is listed (default: only list).")
@click.option(
    "--grace",
    "grace_hours",
    default=24.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Keep unreferenced objects younger than this many hours (a publish in flight).",
)
@_verbose_option
def repo_gc(
    store_url: str, endpoint_url: str | None, delete: bool, grace_hours: float, verbose: bool
) -> int:
    """List objects no metadata version references (a lost or killed publish's).

    Never lists an object any targets version still in the store names, nor one written
    within --grace; --delete removes the listed ones."""
    from edgepack.server.releases.gc import collect_garbage

    _setup_logging(verbose)
    rr = _open(store_url, endpoint_url, None)
    report = collect_garbage(rr.store, delete=delete, grace_seconds=grace_hours * 3600)
    for info in report.unreferenced:
        click.echo(f"{'deleted' if delete else 'unreferenced'} {info.key} {_fmt_size(info.size)}")
    for up in report.stale_uploads:
        idle = (time.time() - up.last_activity) / 3600
        click.echo(
            f"{'aborted' if delete else 'incomplete upload'} {up.key} {_fmt_size(up.size)} "
            f"(idle {idle:.1f} h)"
        )
    verb = "deleted" if delete else "reclaimable (pass --delete)"
    record(
        store=rr.store.url,
        deleted=delete,
        unreferenced=[{"key": i.key, "size": i.size} for i in report.unreferenced],
        reclaimable_bytes=report.reclaimable_bytes,
        referenced=report.referenced,
        metadata_versions=report.metadata_versions,
        young=len(report.young),
        incomplete_uploads=[
            {"key": u.key, "size": u.size, "upload_id": u.upload_id} for u in report.stale_uploads
        ],
        young_uploads=report.young_uploads,
    )
    uploads = sum(u.size for u in report.stale_uploads)
    click.echo(
        f"{rr.store.url}: {len(report.unreferenced)} unreferenced object(s), "
        f"{_fmt_size(report.reclaimable_bytes)} {verb}; {report.referenced} referenced by "
        f"{report.metadata_versions} targets version(s); {len(report.young)} younger than "
        f"{grace_hours:g} h kept; {len(report.stale_uploads)} incomplete upload(s) idle that "
        f"long, {_fmt_size(uploads)} {'aborted' if delete else 'to abort'}, "
        f"{report.young_uploads} more recent kept"
    )
    return EXIT_OK


# ===================================================================== publish etc.


@click.command()
@click.argument("package", type=click.Path(exists=True, dir_okay=False))
@store_option
@click.option("--channel", required=True, help="Channel to publish on (e.g. beta, stable).")
@click.option(
    "--rollout",
    default=100.0,
    show_default=True,
    type=float,
    help="Percentage of devices (by hashed device id) offered the release.",
)
@click.option(
    "--deltas",
    "delta_count",
    default=None,
    type=click.IntRange(0, 64),
    help="Precompute deltas from the last N releases (default: repository policy).",
)
@click.option(
    "--model", default=None, help="Model name in the repository (default: the package's own)."
)
@trusted_key_option("Also require a signature by this public key (NAME.pub); repeatable.")
@endpoint_option
@_keys_option
@_verbose_option
def publish(
    package: str,
    store_url: str,
    channel: str,
    rollout: float,
    delta_count: int | None,
    model: str | None,
    trusted_keys: tuple[str, ...],
    endpoint_url: str | None,
    keys_dir: str,
    verbose: bool,
) -> int:
    """Verify PACKAGE and publish it on a channel: payload first, metadata last."""
    from edgepack.format import load_public_key
    from edgepack.server.releases.repository import PUBLISH_PHASES

    _setup_logging(verbose)
    _percent(rollout)
    keys = [load_public_key(k) for k in trusted_keys]
    rr = _open(store_url, endpoint_url, keys_dir)
    with progress_bars("publishing", phases=PUBLISH_PHASES) as bar:
        result = rr.publish(
            package, channel, rollout=rollout, delta_count=delta_count, trusted_keys=keys,
            model=model, progress=bar,
        )
    rel = result.release
    record(release=rel.to_json(), uploaded=result.uploaded, versions=dict(result.versions))
    click.echo(
        f"published {rel.model} {rel.version} on {rel.channel} ({_fmt_pct(rel.rollout_percent)}"
        f" rollout): {rel.length:,} bytes, sha256 {rel.sha256[:16]}, "
        f"{len(rel.deltas)} delta(s){'' if result.uploaded else ', payload already stored'}; "
        f"{_versions(result.versions)}"
    )
    return EXIT_OK


@click.command()
@click.argument("version")
@click.option("--channel", required=True, help="Channel to promote to (or whose rollout to set).")
@click.option(
    "--rollout",
    default=None,
    type=float,
    help="Percentage of devices (default 100 for a new channel).",
)
@click.option("--model", default=None, help="Model (needed when the repository holds several).")
@store_option
@endpoint_option
@_keys_option
@_verbose_option
def promote(
    version: str,
    channel: str,
    rollout: float | None,
    model: str | None,
    store_url: str,
    endpoint_url: str | None,
    keys_dir: str,
    verbose: bool,
) -> int:
    """Put a published VERSION on another channel, or change its rollout."""
    _setup_logging(verbose)
    _percent(rollout)
    rr = _open(store_url, endpoint_url, keys_dir)
    result = rr.promote(version, channel, rollout=rollout, model=model)
    rel = result.release
    record(release=rel.to_json(), changed=result.changed, versions=dict(result.versions))
    if not result.changed:
        click.echo(
            f"{rel.model} {rel.version} is already on {rel.channel} at "
            f"{_fmt_pct(rel.rollout_percent)}: nothing to do"
        )
    else:
        click.echo(
            f"{rel.model} {rel.version} on {rel.channel} at "
            f"{_fmt_pct(rel.rollout_percent)} rollout, {len(rel.deltas)} delta(s); "
            f"{_versions(result.versions)}"
        )
    return EXIT_OK


@click.command()
@store_option
@endpoint_option
@json_option("releases and metadata")
@click.option("--model", default=None, help="Only this model.")
@click.option("--channel", default=None, help="Only this channel.")
def releases(
    store_url: str,
    endpoint_url: str | None,
    as_json: bool,
    model: str | None,
    channel: str | None,
) -> int:
    """List releases: channel, version, rollout, size, hash, deltas, requirements."""
    from edgepack.server.releases.metadata import format_time, renewal_advice

    _setup_logging(False)
    rr = _open(store_url, endpoint_url, None)
    state = rr.load()
    index = rr.index(state)
    found = index.releases(model, channel)
    expired = rr.expired(state)
    meta = {
        role: {"version": md.signed.version, "expires": format_time(md.signed.expires)}
        for role, md in (
            ("root", state.root_md),
            ("targets", state.targets_md),
            ("snapshot", state.snapshot_md),
            ("timestamp", state.timestamp_md),
        )
    }
    if as_json:
        click.echo(
            json.dumps(
                {
                    "store": rr.store.url,
                    "metadata": meta,
                    "expired": [role for role, _ in expired],
                    "releases": [r.to_json() for r in found],
                },
                indent=2,
            )
        )
        return EXIT_OK
    for role, when in expired:
        click.echo(
            f"warning: {role} metadata expired at {format_time(when)}: clients will "
            f"refuse it ({renewal_advice(role)})",
            err=True,
        )
    click.echo(
        f"{rr.store.url}: "
        + ", ".join(
            f"{role} v{m['version']} (expires {m['expires'][:10]})" for role, m in meta.items()
        )
    )
    if not found:
        click.echo("no releases")
        return EXIT_OK
    rows = [
        (
            "MODEL",
            "CHANNEL",
            "VERSION",
            "ROLLOUT",
            "SIZE",
            "SHA256",
            "DELTAS",
            "MIN RUNTIME",
            "LICENSE",
            "PUBLISHED",
        )
    ]
    for r in found:
        rows.append(
            (
                r.model,
                r.channel,
                r.version,
                _fmt_pct(r.rollout_percent),
                _fmt_size(r.length),
                r.sha256[:12],
                str(len(r.deltas)),
                r.requirements.min_runtime_version,
                str((r.model_card or {}).get("license") or "-"),
                r.published,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return EXIT_OK


COMMANDS = [repo, publish, promote, releases]
