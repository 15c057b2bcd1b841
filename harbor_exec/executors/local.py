"""Where trials run: the seam between ``HarborBackend`` and the machines.

``HarborBackend`` plans a rollout into a ``TrialRequest`` and hands it to a
``TrialExecutor``: ``submit`` returns a ``TrialHandle`` whose ``result()`` is
the finished ``TrialRun``; ``cancel`` stops it (its container is gone within a
second); ``health`` and ``prewarm`` speak for the engines behind it. Nothing
above this seam knows where trials run. ``LocalExecutor`` runs them on worker
threads against this machine's engine; ``harbor_exec.executors.ray`` runs them
on the nodes of a Ray cluster.

A workflow's model endpoint travels as a ``ModelEndpoint``: the executor opens
the rollout's relay (``harbor_exec.executors.relay``) next to the trial's engine, mounts
it into the container, and closes it when the trial ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import anyio
import anyio.to_thread

from harbor_exec.container.exchange import RELAY_DIR
from harbor_exec.errors import HarborExecError
from harbor_exec.sandbox.deps import DepsLayer, ensure_deps_image
from harbor_exec.sandbox.runtime import ContainerEngine, Mount
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.task import Task
from harbor_exec.trial.trial import Trial, TrialRequest, ensure_task_image

logger = logging.getLogger(__name__)

PhaseCallback = Callable[[str], None]


@dataclass(frozen=True)
class ModelEndpoint:
    """The trainer's chat endpoint for one rollout, and the token its workflow uses."""

    url: str
    api_key: str | None = field(repr=False)
    token: str = field(repr=False)


@dataclass(frozen=True)
class ModelUsage:
    """What the rollout's relay saw."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass(frozen=True)
class TrialRun:
    """A finished trial: its result, its directory (where the server keeps trials),
    how many images it built, and where it ran."""

    result: TrialResult
    trial_dir: Path
    images_built: int = 0
    node: str | None = None
    usage: ModelUsage | None = None


@dataclass(frozen=True)
class ExecutorHealth:
    """The engines behind an executor, for ``/health`` and admission."""

    available: bool
    reason: str | None = None  # why not, when not available
    images: dict[str, int] = field(default_factory=dict)  # ours, by kind
    builder: str | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)  # per node, when several


@runtime_checkable
class MultiNodeExecutor(Protocol):
    """An executor whose trials run on several nodes (``RayExecutor``)."""

    def nodes(self) -> list[dict[str, Any]]:
        """Per node: ``node`` (short id), ``address``, ``alive``, ``slots``, ``in_use``..."""
        ...


class TrialHandle(Protocol):
    """One submitted trial."""

    @property
    def name(self) -> str: ...

    async def result(self) -> TrialRun:
        """Wait for the trial to end (it always ends with a ``TrialRun``)."""
        ...


class TrialExecutor(Protocol):
    """Runs trials somewhere. Every method but ``result`` returns at once."""

    def submit(
        self,
        request: TrialRequest,
        *,
        model: ModelEndpoint | None = None,
        on_phase: PhaseCallback | None = None,
    ) -> TrialHandle: ...

    def cancel(self, handle: TrialHandle) -> None:
        """Stop the trial; its container is removed within a second. Idempotent."""
        ...

    def health(self) -> ExecutorHealth: ...

    def available(self) -> str | None:
        """Why trials cannot start now, else None. Cheap: called on every admission."""
        ...

    def pid_max(self) -> int:
        """The lowest ``kernel.pid_max`` of the hosts trials run on (sizes pids limits)."""
        ...

    def default_prewarm_jobs(self) -> int:
        """How many images to build at once by default."""
        ...

    async def prewarm(self, task: Task, deps: DepsLayer | None) -> int:
        """Build the task's image (and ``deps`` on top) where trials run; returns how
        many images were built."""
        ...

    async def aclose(self) -> None:
        """Cancel what runs, remove every container of ours, release resources."""
        ...


# --------------------------------------------------------------------------- local


class TaskTrialHandle:
    """A submitted trial that runs as an asyncio task (what both executors hand out)."""

    def __init__(self, request: TrialRequest, on_phase: PhaseCallback | None) -> None:
        self.request = request
        self.on_phase = on_phase
        self.task: asyncio.Task[TrialRun] | None = None

    @property
    def name(self) -> str:
        return self.request.trial_name or ""

    async def result(self) -> TrialRun:
        assert self.task is not None
        # Shielded: a caller that stops waiting must not cancel the trial's own task.
        return await asyncio.shield(self.task)


class _LocalHandle(TaskTrialHandle):
    def __init__(self, request: TrialRequest, on_phase: PhaseCallback | None) -> None:
        super().__init__(request, on_phase)
        self.trial: Trial | None = None
        self.cancelled = threading.Event()


def _relay_root() -> Path:
    """Where rollouts' relay sockets live (short: a socket path has 107 bytes at most)."""
    root = Path("/tmp") / "hx-relay"
    root.mkdir(mode=0o711, exist_ok=True)
    return root


H = TypeVar("H", bound=TaskTrialHandle)


class TaskExecutor(ABC, Generic[H]):
    """What both executors share: every trial runs as an asyncio task, kept in
    ``_handles`` until it ends, and one background task (``_background``) runs from
    the first call made on an event loop (constructors stay passive) until ``aclose``.
    """

    def __init__(self) -> None:
        self._handles: set[H] = set()
        self._background_task: asyncio.Task[None] | None = None
        self._closed = False

    def submit(
        self,
        request: TrialRequest,
        *,
        model: ModelEndpoint | None = None,
        on_phase: PhaseCallback | None = None,
    ) -> TrialHandle:
        self._start_background()
        handle = self._new_handle(request, on_phase)
        handle.task = asyncio.get_running_loop().create_task(self._run(handle, model))
        self._handles.add(handle)
        handle.task.add_done_callback(lambda _task: self._handles.discard(handle))
        return handle

    @abstractmethod
    def cancel(self, handle: TrialHandle) -> None: ...

    @abstractmethod
    def _new_handle(self, request: TrialRequest, on_phase: PhaseCallback | None) -> H: ...

    @abstractmethod
    async def _run(self, handle: H, model: ModelEndpoint | None) -> TrialRun: ...

    @abstractmethod
    async def _background(self) -> None: ...

    def _start_background(self) -> None:
        if self._background_task is not None or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._background_task = loop.create_task(self._background())

    async def _stop_trials(self, *, timeout_sec: float = 30.0) -> None:
        """Stop the background task, cancel every trial and wait (bounded) for them to end."""
        self._closed = True
        if self._background_task is not None:
            self._background_task.cancel()
        for handle in list(self._handles):
            self.cancel(handle)
        tasks = [h.task for h in self._handles if h.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_sec)


class LocalExecutor(TaskExecutor[_LocalHandle]):
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

    @property
    def runtime(self) -> ContainerEngine:
        if self._runtime is None:
            from harbor_exec.sandbox.docker import DockerRuntime

            runtime = DockerRuntime()
            runtime.reap_orphans()
            self._runtime = runtime
        return self._runtime

    # ----------------------------------------------------------------- trials

    def _new_handle(self, request: TrialRequest, on_phase: PhaseCallback | None) -> _LocalHandle:
        return _LocalHandle(request, on_phase)

    async def _run(self, handle: _LocalHandle, model: ModelEndpoint | None) -> TrialRun:
        async with contextlib.AsyncExitStack() as stack:
            relay = None
            request = handle.request
            if model is not None:
                relay = await stack.enter_async_context(self._relay(model))
                mount = Mount(str(relay.directory), RELAY_DIR, read_only=True)
                request = replace(request, mounts=[*request.mounts, mount])

            def work() -> TrialRun:
                trial = Trial(self.runtime, request, on_phase=handle.on_phase)
                handle.trial = trial
                if handle.cancelled.is_set():
                    trial.cancel()
                result = trial.run()
                return TrialRun(result, trial.dir, trial.images_built)

            try:
                run = await anyio.to_thread.run_sync(
                    work, limiter=self._threads, abandon_on_cancel=True
                )
            except asyncio.CancelledError:
                self.cancel(handle)
                raise
            if relay is None:
                return run
            usage = relay.usage
            return replace(
                run,
                usage=ModelUsage(
                    usage.requests, usage.prompt_tokens, usage.completion_tokens, usage.total_tokens
                ),
            )

    def _relay(self, model: ModelEndpoint) -> Any:
        import httpx  # the server extra; workflows need it

        from harbor_exec.executors.relay import ModelRelay

        if self._relay_transport is None:
            # One upstream connection pool for every rollout's relay.
            self._relay_transport = httpx.AsyncHTTPTransport(retries=1)
        return ModelRelay(
            upstream_url=model.url,
            api_key=model.api_key,
            token=model.token,
            directory=_relay_root() / f"r-{secrets.token_hex(6)}",
            transport=self._relay_transport,
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
        return ExecutorHealth(available=True, images=images, builder=runtime.builder)

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

    async def prewarm(self, task: Task, deps: DepsLayer | None) -> int:
        def build() -> int:
            image, built = ensure_task_image(self.runtime, task)
            if deps is None:
                return int(built)
            _tag, deps_built = ensure_deps_image(self.runtime, image, deps)
            return int(built) + int(deps_built)

        return await anyio.to_thread.run_sync(build, limiter=self._threads)

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
        if self._runtime is not None:
            left = await anyio.to_thread.run_sync(self._runtime.remove_owned)
            if left:
                logger.warning("removed %d container(s) still running at shutdown", left)


__all__ = [
    "ExecutorHealth",
    "LocalExecutor",
    "ModelEndpoint",
    "ModelUsage",
    "TaskExecutor",
    "TaskTrialHandle",
    "TrialExecutor",
    "TrialHandle",
    "TrialRun",
]
