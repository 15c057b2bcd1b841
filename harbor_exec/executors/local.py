"""Trials on worker threads against this machine's engine (``LocalExecutor``).

The seam it implements and the values it takes and returns are in
``harbor_exec.executors.base`` and ``harbor_exec.executors.spec``. A workflow's
model endpoint (``TrialSecrets.model``) gets the rollout's relay
(``harbor_exec.network.relay``) on this machine, mounted into the container and
closed when the trial ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from harbor_exec.agents.native.layer import AgentLayer, ensure_agent_layer
from harbor_exec.container.exchange import RELAY_DIR
from harbor_exec.errors import HarborExecError
from harbor_exec.executors.base import (
    AsyncTrialExecutor,
    AsyncTrialHandle,
    ExecutorHealth,
    TrialHandle,
    TrialRun,
)
from harbor_exec.executors.spec import ModelEndpoint, TrialContent, TrialSecrets, trial_request
from harbor_exec.network.packages.build_route import BuildCache, build_cache
from harbor_exec.sandbox.deps import DepsLayer, ensure_deps_env
from harbor_exec.sandbox.runtime import ContainerEngine, Mount
from harbor_exec.tasks.task import Task
from harbor_exec.trial.factory import create_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import PhaseCallback, Trial, ensure_task_image
from harbor_exec.trial.warm import Arrival, WarmPool, WarmStats

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _LocalHandle(AsyncTrialHandle):
    trial: Trial | None = dataclasses.field(default=None, init=False)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event, init=False)


def _relay_root() -> Path:
    """Where rollouts' relay sockets live (short: a socket path has 107 bytes at most)."""
    root = Path("/tmp") / "hx-relay"
    root.mkdir(mode=0o711, exist_ok=True)
    return root


class LocalExecutor(AsyncTrialExecutor[_LocalHandle]):
    """Trials on worker threads against one ``ContainerRuntime`` (this machine's engine).

    Its constructor only reads configuration; the runtime is opened on first use.
    The background task reaps containers whose owner died (and removals owed while
    the engine was away) every ``reap_interval_sec``, faster while the engine is down.
    """

    def __init__(
        self,
        runtime: ContainerEngine | None = None,
        *,
        max_threads: int = 64,
        reap_interval_sec: float = 5.0,
    ) -> None:
        super().__init__()
        self._runtime = runtime
        self._threads = anyio.CapacityLimiter(max_threads)
        self.reap_interval_sec = reap_interval_sec
        self._relay_transport: Any = None
        self._warm_pool: WarmPool | None = None

    @property
    def runtime(self) -> ContainerEngine:
        if self._runtime is None:
            from harbor_exec.sandbox.docker import DockerRuntime

            runtime = DockerRuntime()
            runtime.reap_orphans()
            self._runtime = runtime
        return self._runtime

    @property
    def warm_pool(self) -> WarmPool:
        """This engine's warm containers (made as trials show their demand)."""
        if self._warm_pool is None:
            self._warm_pool = WarmPool(self.runtime)
        return self._warm_pool

    def expect(self, task: str, *, queued: bool, group: tuple[str, int] | None = None) -> Arrival:
        # No pool yet: no trial has run, so no template it could make.
        pool = self._warm_pool
        return pool.expect(task, queued=queued, group=group) if pool else Arrival()

    def warm_stats(self) -> WarmStats | None:
        """This engine's warm pool's figures (None before its first trial)."""
        return self._warm_pool.stats() if self._warm_pool is not None else None

    # ----------------------------------------------------------------- trials

    @property
    def trials_run_here(self) -> bool:
        return True

    def _new_handle(
        self,
        spec: TrialSpec,
        secrets: TrialSecrets,
        content: TrialContent,
        on_phase: PhaseCallback | None,
    ) -> _LocalHandle:
        return _LocalHandle(spec, secrets, content, on_phase)

    async def _run(self, handle: _LocalHandle) -> TrialRun:
        async with contextlib.AsyncExitStack() as stack:
            relay = None
            mounts: list[Mount] = []
            model = handle.secrets.model
            use = handle.spec.agent.relay  # how this agent reaches the relay
            if model is not None:
                relay = await stack.enter_async_context(self._relay(model, use.record_chat))
                if use.mount:
                    mounts.append(Mount(str(relay.directory), RELAY_DIR, read_only=True))
            request = trial_request(
                handle.spec,
                handle.secrets,
                handle.content,
                mounts=mounts,
                relay_socket=(
                    str(relay.socket_path) if relay is not None and use.socket_path else None
                ),
                relay_chat=_last_chat(relay) if relay is not None and use.record_chat else None,
                package_cache=self.cache_service,
                # A trial that waits for its turn was started ahead of it by a job that
                # knows its schedule (harbor_exec.jobs.ahead): no warm container for it.
                warm_pool=(
                    self.warm_pool
                    if handle.spec.policy.warm_containers > 0 and handle.wait_turn is None
                    else None
                ),
                wait_turn=handle.wait_turn,
            )

            def work() -> TrialRun:
                trial = create_trial(self.runtime, request, on_phase=handle.on_phase)
                handle.trial = trial
                if handle.cancelled.is_set():
                    trial.cancel()
                result = trial.run()
                return TrialRun(result, trial.dir, trial.images_built, output=trial.output)

            try:
                run = await anyio.to_thread.run_sync(
                    work, limiter=self._threads, abandon_on_cancel=True
                )
            except asyncio.CancelledError:
                self.cancel(handle)
                raise
            if relay is None:
                return run
            # A copy: the relay's own counts are done with once it closes.
            return dataclasses.replace(run, usage=dataclasses.replace(relay.usage))

    def _relay(self, model: ModelEndpoint, record_chat: bool = False) -> Any:
        import httpx  # the server extra; workflows need it

        from harbor_exec.network.relay import ModelRelay, RelayLimits

        if self._relay_transport is None:
            # One upstream connection pool for every rollout's relay.
            self._relay_transport = httpx.AsyncHTTPTransport(retries=1)
        return ModelRelay(
            upstream_url=model.url,
            api_key=model.api_key,
            token=model.token,
            directory=_relay_root() / f"r-{secrets.token_hex(6)}",
            transport=self._relay_transport,
            limits=RelayLimits(extra_routes=model.extra_routes),
            record_chat=record_chat,
        )

    def cancel(self, handle: TrialHandle) -> None:
        assert isinstance(handle, _LocalHandle)
        handle.cancelled.set()
        if handle.trial is not None:
            # Removing the container takes milliseconds; never on the event loop.
            threading.Thread(target=handle.trial.cancel, daemon=True).start()

    # ----------------------------------------------------------------- engine

    def health(self) -> ExecutorHealth:
        self._start_background()
        runtime = self.runtime
        if not runtime.engine_available:
            return ExecutorHealth(
                available=False,
                reason=f"the Docker engine at {runtime.engine_url} is not answering; rollouts "
                "are admitted again as soon as it is back",
                builder=runtime.builder,
            )
        images: dict[str, int] = {}
        try:
            for info in runtime.list_images():
                images[info.kind or "other"] = images.get(info.kind or "other", 0) + 1
        except HarborExecError as exc:
            return ExecutorHealth(available=False, reason=str(exc), builder=runtime.builder)
        warm = self.warm_stats()
        return ExecutorHealth(available=True, images=images, builder=runtime.builder, warm=warm)

    def available(self) -> str | None:
        self._start_background()
        runtime = self._runtime
        if runtime is not None and not runtime.engine_available:
            return (
                f"the Docker engine at {runtime.engine_url} is not answering; rollouts are "
                "admitted again as soon as it is back"
            )
        return None

    def pid_max(self) -> int:
        return self.runtime.pid_max()

    def default_prewarm_jobs(self) -> int:
        return self.runtime.engine_cpus()

    async def prewarm(
        self, task: Task, deps: DepsLayer | None, policy: SandboxPolicy | None = None
    ) -> int:
        def build() -> int:
            image, built = ensure_task_image(self.runtime, task, self._build_cache(policy))
            if deps is None:
                return int(built)
            _volume, deps_built = ensure_deps_env(self.runtime, deps, image)
            return int(built) + int(deps_built)

        return await anyio.to_thread.run_sync(build, limiter=self._threads)

    async def prewarm_agent_layer(
        self, task: Task, layer: AgentLayer, policy: SandboxPolicy | None = None
    ) -> int:
        """Install an in-container agent's layer on this engine (on ``task``'s image,
        which only hosts the install); 1 when installed now."""

        def build() -> int:
            image, built = ensure_task_image(self.runtime, task, self._build_cache(policy))
            _volume, layer_built = ensure_agent_layer(self.runtime, layer, image)
            return int(built) + int(layer_built)

        return await anyio.to_thread.run_sync(build, limiter=self._threads)

    def _build_cache(self, policy: SandboxPolicy | None) -> BuildCache | None:
        """How this executor's image builds reach its package cache (None: off)."""
        return build_cache(self.cache_service, policy.egress if policy is not None else None)

    async def _background(self) -> None:
        """Reap periodically (owed removals, dead owners' containers), and poll the
        engine quickly while it is down so admissions resume as soon as it is back."""
        while not self._closed:
            runtime = self.runtime
            try:
                await anyio.to_thread.run_sync(runtime.reap)
            except Exception:
                logger.warning("periodic reap failed", exc_info=True)
            await asyncio.sleep(self.reap_interval_sec if runtime.engine_available else 0.5)

    async def aclose(self) -> None:
        await self._stop_trials()
        if self._relay_transport is not None:
            await self._relay_transport.aclose()
        if self._warm_pool is not None:
            await anyio.to_thread.run_sync(self._warm_pool.close)
        if self._runtime is not None:
            left = await anyio.to_thread.run_sync(self._runtime.remove_owned)
            if left:
                logger.warning("removed %d container(s) still running at shutdown", left)


def _last_chat(relay: Any) -> Callable[[], Mapping[str, Any] | None]:
    """The relay's record of its last chat call, read when the agent is done."""
    return lambda: relay.last_chat


__all__ = ["LocalExecutor"]
