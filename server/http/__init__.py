"""edgepack.server.http: the update server (``edgepack serve``), FastAPI on uvicorn.

Modules, one job each:

* :mod:`.config` - :class:`ServeConfig`, every knob and bound;
* :mod:`.view` - the verified metadata, re-read when ``timestamp.json`` changes;
* :mod:`.schemas` - the update-check wire format (pydantic, every field bounded);
* :mod:`.planner` - the cheapest safe plan for a device (pure);
* :mod:`.payloads` - ranges, ETags and streaming of content-addressed bytes;
* :mod:`.metadata`, :mod:`.targets` - the TUF-facing routes;
* :mod:`.ondemand` - deltas computed once per pair across replicas;
* :mod:`.ops` - body limits, JSON access logs, health and readiness;
* :mod:`.app` - the app factory; :mod:`.runner` - uvicorn.
"""

from .config import ServeConfig

__all__ = ["ServeConfig", "create_app"]


def __getattr__(name: str) -> object:  # FastAPI is imported only when the app is built
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
