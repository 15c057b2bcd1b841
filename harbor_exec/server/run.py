"""Run a rollout app with uvicorn, as ``harbor-exec serve`` and ``osmosis eval run`` expect.

``osmosis eval run`` starts a workspace's rollout entrypoint as a child process
and tells it where to listen in ``_OSMOSIS_ROLLOUT_PORT`` (and where artifacts go in
``_OSMOSIS_ROLLOUT_ARTIFACT_ROOT``, read by ``default_artifact_root``). Explicit
settings always win over those variables.

uvicorn runs on uvloop's event loop with the httptools HTTP/1.1 parser (both in
the ``server`` extra); when either is missing it falls back, on its own, to
asyncio's loop or to h11.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
from typing import Any, Final

__all__ = [
    "DEFAULT_PORT",
    "KEEP_ALIVE_SEC",
    "OSMOSIS_PORT_ENV",
    "resolve_port",
    "serve_app",
    "uvicorn_implementations",
]


OSMOSIS_PORT_ENV: Final = "_OSMOSIS_ROLLOUT_PORT"
DEFAULT_PORT: Final = 8000
# Outlives common load balancers' idle timeouts (2100 s), as the reference scaffold does.
KEEP_ALIVE_SEC: Final = 2160
_STARTUP_FAILURE: Final = 3  # uvicorn's exit code


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


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def uvicorn_implementations() -> tuple[str, str]:
    """uvicorn's ``(loop, http)``: ``("uvloop", "httptools")`` when installed, each
    falling back on its own to ``"asyncio"`` / ``"h11"``."""
    return (
        "uvloop" if _importable("uvloop") else "asyncio",
        "httptools" if _importable("httptools") else "h11",
    )


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now: a port in use is said before anything
    starts (the backend, a prewarm), not after "Application startup complete"."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise OSError(
            exc.errno,
            f"cannot listen on {host}:{port}: {exc.strerror} (another server there? pick "
            "another with --port)",
        ) from None
    return listener


def serve_app(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    access_log: bool = False,
    log_level: str = "info",
    listener: socket.socket | None = None,
) -> None:
    """Serve ``app`` with uvicorn until interrupted (port: see ``resolve_port``), on
    ``listener`` when given (``bind_listener``)."""
    import uvicorn

    loop, http = uvicorn_implementations()
    config = uvicorn.Config(
        app,
        host=host,
        port=resolve_port(port),
        loop=loop,
        http=http,
        timeout_keep_alive=KEEP_ALIVE_SEC,
        access_log=access_log,
        log_level=log_level,
    )
    # The Config has set up uvicorn's loggers.
    logging.getLogger("uvicorn.error").info("event loop %s, HTTP parser %s", loop, http)
    server = uvicorn.Server(config)
    # As uvicorn.run: Ctrl-C is a normal stop, a failed start-up exits with 3.
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[listener] if listener is not None else None)
    if not server.started:
        raise SystemExit(_STARTUP_FAILURE)
