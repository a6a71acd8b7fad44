"""Run the app on uvicorn: the config goes to every worker through the environment."""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidStoreURLError
from ..store import open_store
from .config import CONFIG_ENV, ServeConfig

__all__ = ["run", "uvicorn_log_config"]

APP_FACTORY = "edgepack.server.http.app:create_app_from_env"


def uvicorn_log_config(level: str = "INFO") -> dict[str, Any]:
    """Access lines (already JSON) and edgepack's own lines on stderr, unadorned;
    uvicorn's own access log is off (ours has the request id and the plan)."""
    plain = {"format": "%(message)s"}
    tagged = {"format": "%(levelname)s %(name)s: %(message)s"}
    stream = "ext://sys.stderr"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": plain, "tagged": tagged},
        "handlers": {
            "access": {"class": "logging.StreamHandler", "formatter": "plain", "stream": stream},
            "default": {"class": "logging.StreamHandler", "formatter": "tagged", "stream": stream},
        },
        "loggers": {
            "edgepack.server.http.access": {
                "handlers": ["access"],
                "level": "INFO",
                "propagate": False,
            },
            "edgepack": {"handlers": ["default"], "level": level},
            "uvicorn": {"handlers": ["default"], "level": level},
        },
    }


def run(config: ServeConfig, *, host: str, port: int, workers: int, log_level: str) -> None:
    import uvicorn

    store = open_store(config.store_url, endpoint_url=config.endpoint_url, create=False)
    if config.redirect and not hasattr(store, "bucket"):
        raise InvalidStoreURLError(f"--redirect needs an s3:// store, not {store.url}")
    store.close()
    os.environ[CONFIG_ENV] = config.to_env()
    uvicorn.run(
        APP_FACTORY,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        access_log=False,
        log_config=uvicorn_log_config(log_level.upper()),
        timeout_graceful_shutdown=10,
    )
