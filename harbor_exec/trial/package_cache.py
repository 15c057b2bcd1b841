"""A public-network trial through the server's package cache (docs/package-cache.md).

When the operator turns the cache on (``SandboxPolicy.package_cache``) and the task
neither opts out nor runs without network, the trial gets an egress proxy of its own
(``harbor_exec.sandbox.egress``, policy ``public``) whose upstream is the cache; its
unix socket and the public trust directory are mounted read-only into the agent's and
the verifier's containers, the container env carries the proxy variables and the
trust hooks, and before each phase the in-container forwarder is started on
``127.0.0.1:PROXY_PORT``. The container keeps its own network: a program that ignores
the proxy variables still reaches the internet directly (and is just not cached).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Final

from harbor_exec.container.exchange import RUNTIME_PYTHON
from harbor_exec.errors import HarborExecError
from harbor_exec.sandbox.egress import EgressMode, EgressPolicy, EgressProxy, EgressProxyThread
from harbor_exec.sandbox.egress.service import PackageCacheService, TrialCache
from harbor_exec.sandbox.egress.trust import TRUST_MOUNT, proxy_env, task_opts_out
from harbor_exec.sandbox.runtime import ContainerRuntime, Mount
from harbor_exec.trial.task import NetworkMode, Task

__all__ = ["EGRESS_MOUNT", "PROXY_PORT", "RESULT_FILE", "TrialPackageCache", "wanted"]

logger = logging.getLogger(__name__)

EGRESS_MOUNT: Final = "/run/harbor-exec-egress"
PROXY_PORT: Final = 3128
RESULT_FILE: Final = "package-cache.json"

# The in-container forwarder: 127.0.0.1:PORT piped byte for byte to the proxy's socket,
# detached (its own session), standard library only, on the runtime's interpreter.
_FORWARDER: Final = """
import asyncio, os, socket, sys
sock_path, port = sys.argv[1], int(sys.argv[2])
listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", port))
listener.listen(256)
if os.fork():
    print(port, flush=True)
    os._exit(0)
os.setsid()
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
async def pipe(src, dst):
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except OSError:
        dst.close()
async def serve(reader, writer):
    try:
        up_reader, up_writer = await asyncio.open_unix_connection(sock_path)
    except OSError:
        writer.close()
        return
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
    writer.close()
    up_writer.close()
async def main():
    server = await asyncio.start_server(serve, sock=listener)
    await server.serve_forever()
asyncio.run(main())
"""


def wanted(service: PackageCacheService | None, task: Task) -> bool:
    """Whether ``task``'s trial goes through the cache: the server has one, the task
    has public network and does not opt out."""
    if service is None:
        return False
    env = task.config.environment
    if env.network_mode is not NetworkMode.PUBLIC:
        return False
    return not task_opts_out(task.config.metadata, env.env)


class TrialPackageCache:
    """One trial's proxy into the cache; ``close`` writes ``package-cache.json``."""

    def __init__(self, service: PackageCacheService, trial: str) -> None:
        self.service = service
        self.session: TrialCache = service.session()
        # A short path: a unix socket's path has at most 107 bytes.
        self._scratch = Path(tempfile.mkdtemp(prefix="hx-pc-"))
        self.proxy = EgressProxy(
            directory=self._scratch / "e",
            trial=trial,
            overrides=service.config.overrides,
            dns=service.config.dns,
            upstream=service.upstream(self.session),
        )
        self._thread = EgressProxyThread(self.proxy)
        self._thread.start()
        self._thread.set_phase("agent", EgressPolicy(EgressMode.PUBLIC))

    def mounts(self) -> list[Mount]:
        return [
            Mount(str(self.proxy.directory), EGRESS_MOUNT, read_only=True),
            Mount(str(self.service.trust_dir), TRUST_MOUNT, read_only=True),
        ]

    def env(self) -> dict[str, str]:
        return proxy_env(PROXY_PORT)

    def start_forwarder(self, runtime: ContainerRuntime, container_id: str, phase: str) -> None:
        """Start the forwarder in the container (again: the agent may have ended it)."""
        self._thread.set_phase(phase, EgressPolicy(EgressMode.PUBLIC))
        socket_path = f"{EGRESS_MOUNT}/{self.proxy.socket_path.name}"
        try:
            result = runtime.exec(
                container_id,
                [RUNTIME_PYTHON, "-I", "-c", _FORWARDER, socket_path, str(PROXY_PORT)],
                user="root",
                timeout_sec=60,
            )
        except HarborExecError as exc:
            logger.warning("package cache: the forwarder did not start: %s", exc)
            return
        if result.exit_code != 0:
            # Traffic then fails at the proxy address: the task sees a network error,
            # as it would without a network.
            logger.warning(
                "package cache: the forwarder did not start (exit %s): %s",
                result.exit_code,
                result.errors.decode("utf-8", "replace")[-300:],
            )

    def close(self, trial_dir: Path | None) -> None:
        try:
            self._thread.close()
        finally:
            shutil.rmtree(self._scratch, ignore_errors=True)
            if trial_dir is not None:
                try:
                    self.session.write(trial_dir / RESULT_FILE)
                except OSError as exc:
                    logger.warning("package cache: %s not written: %s", RESULT_FILE, exc)
