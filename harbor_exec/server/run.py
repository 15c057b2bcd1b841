"""Run a rollout app with uvicorn, as ``harbor-exec serve`` and ``osmosis eval run`` expect.

``osmosis eval run`` starts a workspace's rollout entrypoint as a child process
and tells it where to listen in ``_OSMOSIS_ROLLOUT_PORT`` (and where artifacts go in
``_OSMOSIS_ROLLOUT_ARTIFACT_ROOT``, read by ``default_artifact_root``). Explicit
settings always win over those variables.
"""

from __future__ import annotations

import os
from typing import Any, Final

__all__ = ["DEFAULT_PORT", "KEEP_ALIVE_SEC", "OSMOSIS_PORT_ENV", "resolve_port", "serve_app"]

OSMOSIS_PORT_ENV: Final = "_OSMOSIS_ROLLOUT_PORT"
DEFAULT_PORT: Final = 8000
# Outlives common load balancers' idle timeouts (2100 s), as the reference scaffold does.
KEEP_ALIVE_SEC: Final = 2160


def resolve_port(port: int | None) -> int:
    """``port`` when given, else ``$_OSMOSIS_ROLLOUT_PORT``, else 8000."""
    if port is not None:
        return port
    raw = os.environ.get(OSMOSIS_PORT_ENV, "").strip()
    if not raw:
        return DEFAULT_PORT
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{OSMOSIS_PORT_ENV}={raw!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise ValueError(f"{OSMOSIS_PORT_ENV}={raw!r} is not a port number (0-65535)")
    return value


def serve_app(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    access_log: bool = False,
    log_level: str = "info",
) -> None:
    """Serve ``app`` with uvicorn until interrupted (port: see ``resolve_port``)."""
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=resolve_port(port),
        timeout_keep_alive=KEEP_ALIVE_SEC,
        access_log=access_log,
        log_level=log_level,
    )
