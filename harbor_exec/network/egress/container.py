"""How a container reaches its trial's egress proxy: mount point, port, variables.

The proxy's directory is bind-mounted read-only at ``EGRESS_MOUNT``; the
forwarder (``harbor_exec.container.forward``, run from its source on the
read-only runtime's interpreter, so nothing in the image takes part) listens on
``127.0.0.1:EGRESS_PORT`` inside the container and pipes to the socket; the
standard proxy variables (``proxy_env``) point every program there that honours
them (curl, wget, pip, uv, apt, git, npm, Python's urllib, requests, httpx, ...).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Final

from harbor_exec.container import forward
from harbor_exec.container.exchange import RUNTIME_PYTHON
from harbor_exec.errors import EnvironmentStartError, HarborExecError
from harbor_exec.network.egress.proxy import EGRESS_SOCKET_NAME
from harbor_exec.sandbox.runtime import ContainerRuntime
from harbor_exec.sandbox.runtime_volume import KEEP_ALIVE_USER

__all__ = [
    "EGRESS_MOUNT",
    "EGRESS_PORT",
    "EGRESS_PROXY_URL",
    "EGRESS_SOCKET",
    "forwarder_command",
    "forwarder_with_container",
    "proxy_env",
    "start_forwarder",
]

EGRESS_MOUNT: Final = "/run/harbor-exec/egress"
EGRESS_SOCKET: Final = f"{EGRESS_MOUNT}/{EGRESS_SOCKET_NAME}"
#: The forwarder's port on the container's own loopback (network ``none``: nothing
#: else listens there unless the task does); the standard proxy port.
EGRESS_PORT: Final = 3128
EGRESS_PROXY_URL: Final = f"http://127.0.0.1:{EGRESS_PORT}"
_NO_PROXY: Final = "localhost,127.0.0.1,::1"


def proxy_env(url: str = EGRESS_PROXY_URL) -> dict[str, str]:
    """The proxy variables, both spellings (curl reads ``http_proxy`` only in lower
    case; others read upper case), with loopback left direct (the model relay's
    forwarder is on 127.0.0.1 too)."""
    env: dict[str, str] = {}
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        env[name] = env[name.upper()] = url
    env["no_proxy"] = env["NO_PROXY"] = _NO_PROXY
    return env


@cache
def _forward_source() -> str:
    return Path(forward.__file__).read_text(encoding="utf-8")


def forwarder_command(
    port: int = EGRESS_PORT,
    socket: str = EGRESS_SOCKET,
    host: str = "127.0.0.1",
    *,
    in_use_ok: bool = False,
) -> list[str]:
    """The exec that starts the forwarder (it prints its port and detaches)."""
    # -S: no site module (the standard library only), a faster start.
    command = [RUNTIME_PYTHON, "-I", "-S", "-c", _forward_source(), "--socket", socket]
    return [*command, "--port", str(port), "--host", host, *(["--in-use-ok"] if in_use_ok else [])]


def forwarder_with_container(token: str) -> list[str]:
    """``ContainerSpec.before_keep_alive`` that starts the forwarder with the container
    (no exec): it listens, announces ``token`` on the egress socket (``EgressProxy.
    expect_forwarder``), then becomes the keep-alive."""
    return [*forwarder_command(), "--ready", token, "--then"]


def start_forwarder(
    runtime: ContainerRuntime,
    container_id: str,
    what: str,
    *,
    host: str = "127.0.0.1",
    in_use_ok: bool = False,
) -> None:
    """Start the forwarder in the container as the runtime's own uid (an agent that is
    not root cannot end it); ``EnvironmentStartError`` naming ``what`` when it fails.
    ``in_use_ok``: see ``forward.run_forward``."""
    command = forwarder_command(host=host, in_use_ok=in_use_ok)
    try:
        ran = runtime.exec(container_id, command, user=KEEP_ALIVE_USER, timeout_sec=60)
    except HarborExecError as exc:
        raise EnvironmentStartError(f"{what} did not start: {exc}") from None
    if ran.exit_code != 0:
        detail = ran.errors.decode("utf-8", errors="replace").strip()[-300:]
        raise EnvironmentStartError(
            f"{what} did not start (exit {ran.exit_code}): {detail or 'no output'}"
        )
