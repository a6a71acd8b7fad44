"""``edgepack serve``: the update server (listed in :data:`edgepack.cli.app.COMMAND_MODULES`)."""

from __future__ import annotations

import click

from .options import endpoint_option, json_option, store_option


@click.command()
@store_option
@endpoint_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--workers", default=1, show_default=True, type=click.IntRange(1, 256),
    help="Worker processes on this machine.",
)
@click.option(
    "--refresh-seconds", default=2.0, show_default=True, type=click.FloatRange(0, 3600),
    help="Re-read timestamp.json at most this often: a publish is visible within this "
    "(plus one metadata load).",
)
@click.option(
    "--redirect", is_flag=True,
    help="S3 store: answer payload requests with a presigned URL (307) instead of the bytes.",
)
@click.option(
    "--presign-seconds", default=300, show_default=True, type=click.IntRange(1, 7 * 24 * 3600),
    help="Lifetime of a presigned URL (--redirect).",
)
@click.option(
    "--no-on-demand-deltas", is_flag=True,
    help="Never compute a missing delta: devices without a precomputed one get the full package.",
)
@click.option(
    "--delta-wait-seconds", default=5.0, show_default=True, type=click.FloatRange(0, 600),
    help="How long an update check waits for an on-demand delta before answering `full`.",
)
@click.option(
    "--log-level", default="info", show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
@json_option("a failure to start (stdout has nothing else; the access log on stderr is JSON lines)")
@click.option(
    "-q", "--quiet", is_flag=True, help="Log only warnings and errors (--log-level warning)."
)
def serve(
    store_url: str,
    endpoint_url: str | None,
    host: str,
    port: int,
    workers: int,
    refresh_seconds: float,
    redirect: bool,
    presign_seconds: int,
    no_on_demand_deltas: bool,
    delta_wait_seconds: float,
    log_level: str,
    as_json: bool,
    quiet: bool,
) -> None:
    """Serve update checks, TUF metadata and payloads from the release store.

    The server keeps no state of its own: run as many replicas as you like (on one
    machine with --workers N, or one `edgepack serve` per machine, all with the same
    --store, behind any HTTP load balancer). Each re-reads the store's timestamp.json
    at most every --refresh-seconds, so a publish reaches every replica within that.
    Health: GET /healthz (process up) and /readyz (store readable, metadata verifies);
    the OpenAPI document is at /openapi.json. One JSON access line per request goes to
    stderr.
    """
    from edgepack.server.http.config import ServeConfig
    from edgepack.server.http.runner import run

    config = ServeConfig(
        store_url=store_url,
        endpoint_url=endpoint_url,
        refresh_seconds=refresh_seconds,
        redirect=redirect,
        presign_seconds=presign_seconds,
        on_demand_deltas=not no_on_demand_deltas,
        delta_wait_seconds=delta_wait_seconds,
    )
    level = "warning" if quiet and log_level in ("debug", "info") else log_level
    run(config, host=host, port=port, workers=workers, log_level=level)


COMMANDS = [serve]
