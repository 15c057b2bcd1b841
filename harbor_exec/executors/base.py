"""Where trials run: the seam between ``HarborBackend`` and the machines.

``HarborBackend`` plans a rollout into a ``TrialSpec`` (with its ``TrialSecrets``
and ``TrialContent``, ``harbor_exec.executors.spec``) and hands it to a
``TrialExecutor``: ``submit`` returns a ``TrialHandle`` whose ``result()`` is the
finished ``TrialRun``; ``cancel`` stops it (its container is gone within a
second); ``health`` and ``prewarm`` speak for the engines behind it. Nothing above
this seam knows where trials run: ``LocalExecutor`` (``harbor_exec.executors.local``)
runs them on worker threads against this machine's engine, ``RayExecutor``
(``harbor_exec.executors.ray``) on the nodes of a Ray cluster. Both are
``AsyncTrialExecutor``: each trial an asyncio task.

A workflow's model endpoint travels in ``TrialSecrets.model``: the executor opens
the rollout's relay (``harbor_exec.network.relay``) next to the trial's engine,
mounts it into the container, and closes it when the trial ends; what the relay
counted comes back as the run's ``ModelUsage``.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

from harbor_exec.executors.spec import ModelEndpoint, TrialContent, TrialSecrets
from harbor_exec.network.usage import ModelUsage
from harbor_exec.protocol import NodeStatus
from harbor_exec.sandbox.deps import DepsLayer
from harbor_exec.tasks.task import Task
from harbor_exec.trial.outputs import TrialOutput
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import PhaseCallback, WaitTurn
from harbor_exec.trial.warm import Arrival, WarmStats

if TYPE_CHECKING:
    from harbor_exec.network.packages.service import PackageCacheConfig, PackageCacheService


@dataclass(frozen=True)
class TrialRun:
    """A finished trial: Harbor's record of it (``result``, also ``result.json`` in
    ``trial_dir``, where the server keeps trials), what its exchange files said
    (``output``), how many images it built, where it ran and its model usage."""

    result: TrialResult
    trial_dir: Path
    images_built: int = 0
    node: str | None = None
    usage: ModelUsage | None = None
    output: TrialOutput = field(default_factory=TrialOutput)


@dataclass(frozen=True)
class ExecutorHealth:
    """The engines behind an executor, for ``/health`` and admission."""

    available: bool
    reason: str | None = None  # why not, when not available
    images: dict[str, int] = field(default_factory=dict)  # ours, by kind
    builder: str | None = None
    nodes: list[NodeStatus] = field(default_factory=list)  # per node, when several
    warm: WarmStats | None = None  # this engine's warm containers, once it had a trial


@runtime_checkable
class MultiNodeExecutor(Protocol):
    """An executor whose trials run on several nodes (``RayExecutor``)."""

    def nodes(self) -> list[NodeStatus]:
        """Every node known, alive or not, with its slots."""
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
        spec: TrialSpec,
        *,
        secrets: TrialSecrets | None = None,
        content: TrialContent | None = None,
        on_phase: PhaseCallback | None = None,
        wait_turn: WaitTurn | None = None,
    ) -> TrialHandle:
        """Start the trial of ``spec``; ``content`` holds the submitter's copies of
        what the spec names by key (None: the spec's own paths, no bundle).
        ``wait_turn``: ``TrialRequest.wait_turn`` (only where ``trials_run_here``)."""
        ...

    @property
    def trials_run_here(self) -> bool:
        """Whether trials run in this process (a ``wait_turn`` reaches them); a Ray
        cluster's nodes start theirs ahead through their own warm pools."""
        ...

    def cancel(self, handle: TrialHandle) -> None:
        """Stop the trial; its container is removed within a second. Idempotent."""
        ...

    def expect(self, task: str, *, queued: bool, group: tuple[str, int] | None = None) -> Arrival:
        """A rollout of ``task`` arrived: the warm pool makes ready for it
        (``WarmPool.expect``). A Ray cluster's nodes size their pools from their own
        trials only."""
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

    async def prewarm(
        self, task: Task, deps: DepsLayer | None, policy: SandboxPolicy | None = None
    ) -> int:
        """Build the task's image (and ``deps`` on top) where trials run; returns how
        many images were built. With the package cache ``package_cache_service`` turned on
        the build goes through it (``policy``'s egress settings)."""
        ...

    def package_cache_service(self, config: PackageCacheConfig) -> PackageCacheService | None:
        """Turn the package cache on for this executor's trials and builds: the
        service in this process (the executor hands it to each trial request and build;
        the caller closes it), or None when trials run elsewhere and each node runs one of
        its own from ``config`` (Ray)."""
        ...

    async def aclose(self) -> None:
        """Cancel what runs, remove every container of ours, release resources."""
        ...


# --------------------------------------------------------------------------- asyncio base


@dataclass(eq=False)  # handles are compared and hashed by identity
class AsyncTrialHandle:
    """A submitted trial that runs as an asyncio task (what both executors hand out);
    executors subclass it with the fields of their own bookkeeping."""

    spec: TrialSpec
    secrets: TrialSecrets
    content: TrialContent
    on_phase: PhaseCallback | None
    task: asyncio.Task[TrialRun] | None = field(default=None, init=False)
    wait_turn: WaitTurn | None = field(default=None, init=False)

    @property
    def name(self) -> str:
        return self.spec.trial_name or ""

    async def result(self) -> TrialRun:
        assert self.task is not None
        # Shielded: a caller that stops waiting must not cancel the trial's own task.
        return await asyncio.shield(self.task)


H = TypeVar("H", bound=AsyncTrialHandle)


class AsyncTrialExecutor(ABC, Generic[H]):
    """What both executors share: every trial runs as an asyncio task, kept in
    ``_handles`` until it ends, and one background task (``_background``) runs from
    the first call made on an event loop (constructors stay passive) until ``aclose``.
    """

    def __init__(self) -> None:
        self._handles: set[H] = set()
        self._background_task: asyncio.Task[None] | None = None
        self._closed = False
        #: The live package cache this executor's trials and builds go through (set by
        #: ``package_cache_service``; None: off). Beside each trial request, never in a policy.
        self.cache_service: PackageCacheService | None = None

    def submit(
        self,
        spec: TrialSpec,
        *,
        secrets: TrialSecrets | None = None,
        content: TrialContent | None = None,
        on_phase: PhaseCallback | None = None,
        wait_turn: WaitTurn | None = None,
    ) -> TrialHandle:
        if wait_turn is not None and not self.trials_run_here:
            raise ValueError(f"{type(self).__name__} runs trials elsewhere: no wait_turn")
        self._start_background()
        handle = self._new_handle(
            spec, secrets or TrialSecrets(), content or TrialContent(), on_phase
        )
        handle.wait_turn = wait_turn
        handle.task = asyncio.get_running_loop().create_task(self._run(handle))
        self._handles.add(handle)
        handle.task.add_done_callback(lambda _task: self._handles.discard(handle))
        return handle

    @property
    @abstractmethod
    def trials_run_here(self) -> bool: ...

    def expect(self, task: str, *, queued: bool, group: tuple[str, int] | None = None) -> Arrival:
        """No hints where no pool of this process makes the containers."""
        return Arrival()

    @abstractmethod
    def cancel(self, handle: TrialHandle) -> None: ...

    @abstractmethod
    def _new_handle(
        self,
        spec: TrialSpec,
        secrets: TrialSecrets,
        content: TrialContent,
        on_phase: PhaseCallback | None,
    ) -> H: ...

    @abstractmethod
    async def _run(self, handle: H) -> TrialRun: ...

    @abstractmethod
    async def _background(self) -> None: ...

    def package_cache_service(self, config: PackageCacheConfig) -> PackageCacheService | None:
        """This process's service (trials run here), kept as ``cache_service`` for the
        trials and builds to come; see ``TrialExecutor``."""
        # Imported here: the cache needs the server extra (httpx, h11, cryptography).
        from harbor_exec.network.packages.service import PackageCacheService

        self.cache_service = PackageCacheService(config)
        return self.cache_service

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


__all__ = [
    "AsyncTrialExecutor",
    "AsyncTrialHandle",
    "ExecutorHealth",
    "ModelEndpoint",
    "MultiNodeExecutor",
    "PhaseCallback",
    "TrialExecutor",
    "TrialHandle",
    "TrialRun",
]
