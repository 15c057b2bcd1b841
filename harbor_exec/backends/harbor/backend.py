"""``HarborBackend``: every rollout is an isolated Docker trial of a Harbor task.

A thin composition of one-job pieces; one rollout goes through them in order:

1. ``TaskResolver.resolve`` (``harbor_exec.backends.harbor.resolver``): which task snapshot;
2. ``TrialPlanner.plan`` (``harbor_exec.backends.harbor.planner``): the ``TrialSpec`` (agent,
   verifier, sandbox policy), its secrets (for workflows, the model endpoint for the
   relay) and the bundle's files;
3. a slot (``queued`` until then), then ``TrialExecutor.submit``
   (``harbor_exec.executors.base``): the trial runs on this machine's engine
   (``LocalExecutor``) or on a Ray node;
4. ``rollout_outcome`` (``harbor_exec.backends.harbor.outcomes``): the workflow and grader results.

The server owns every rollout's state; this backend keeps only what it needs to
run them (the slots, and the handles of running trials, for cancel).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

import anyio
from pydantic import Field

from harbor_exec.agents.native.config import (
    NativeAgentConfig,
    is_in_container_agent,
    set_litellm_offline,
)
from harbor_exec.agents.native.layer import AgentLayer, AgentLayerError
from harbor_exec.authoring import (
    RolloutContext,
    RolloutErrorCategory,
    RolloutStatus,
)
from harbor_exec.backends.base import ExecutionBackend, default_artifact_root, rollout_of
from harbor_exec.backends.harbor.config import AgentChoice, HarborConfig, check_agent_choice
from harbor_exec.backends.harbor.constructor import HarborKeywords, harbor_config
from harbor_exec.backends.harbor.outcomes import cancelled, category_of, failure, rollout_outcome
from harbor_exec.backends.harbor.planner import (
    PreparedBundle,
    RolloutPlan,
    TrialPlanner,
    prepare_bundle,
)
from harbor_exec.backends.harbor.resolver import RolloutRejected, TaskMode, TaskResolver
from harbor_exec.container.redaction import scrub_tree
from harbor_exec.errors import DatasetError, HarborExecError, TaskError, TrialPhase
from harbor_exec.executors.base import (
    MultiNodeExecutor,
    TrialExecutor,
    TrialHandle,
    TrialRun,
)
from harbor_exec.executors.local import LocalExecutor
from harbor_exec.protocol import (
    BackendHealth,
    ExecutionOutcome,
    ExecutionRequest,
    NodeStatus,
    PrewarmSummary,
    QueueInfo,
    group_hint,
    rollout_dir_name,
)
from harbor_exec.sandbox.runtime import ContainerEngine
from harbor_exec.sources.git import GitTaskSource
from harbor_exec.sources.packages import PackageSource
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.warm import WarmStats

if TYPE_CHECKING:
    from harbor_exec.network.packages.service import PackageCacheService

logger = logging.getLogger(__name__)


#: A native agent's ATIF trajectory (Harbor's ``trajectory.json``), kept beside the
#: rollout's artifacts under another name: the server's own ``trajectory.json`` is there.
ATIF_TRAJECTORY = "atif-trajectory.json"


class HarborHealth(BackendHealth):
    """``HarborBackend``'s part of ``GET /health``."""

    docker: str = "ok"  # "unavailable" while the engine does not answer
    docker_reason: str | None = None
    agent: str = "oracle"
    task_mode: str = "template"
    in_flight: int = 0
    running: int = 0
    queued: int = 0
    capacity: int = 0
    max_queue_depth: int | None = None
    images: dict[str, int] = Field(default_factory=dict)  # ours, by kind
    image_builds: int = 0
    image_builder: str | None = None
    nodes: list[NodeStatus] | None = None  # per node, on a cluster
    blocked_tasks: dict[str, str] = Field(default_factory=dict)
    #: The engine's warm containers (``harbor_exec.trial.warm``): idle now, hits,
    #: misses, hit rate, idle container-seconds, median claim seconds.
    warm_containers: dict[str, float | int | None] | None = None


@dataclass
class _Pending:
    """A rollout this backend was given and has not finished."""

    task: asyncio.Task[Any] | None
    handle: TrialHandle | None = None
    started: bool = False
    grading: bool = False
    cancel_requested: bool = False


@dataclass
class _Teardowns:
    """Trials that gave their slot back at their teardown and are still tearing down:
    at most ``most`` at once (a teardown a policy makes slow holds the next one's slot,
    so the containers alive stay within twice the slots, as ``validate``'s do)."""

    most: int
    now: int = 0


class _Slot:
    """One trial slot taken from ``slots``, given back once (on the event loop): at its
    trial's teardown while the teardowns allow (``early``), else when the rollout ends."""

    def __init__(self, slots: asyncio.Semaphore, teardowns: _Teardowns) -> None:
        self._slots: asyncio.Semaphore | None = slots
        self._teardowns = teardowns
        self._early = False

    def early(self) -> None:
        if self._slots is None or self._teardowns.now >= self._teardowns.most:
            return
        self._teardowns.now += 1
        self._early = True
        self._give_back()

    def end(self) -> None:
        self._give_back()
        if self._early:
            self._early = False
            self._teardowns.now -= 1

    def _give_back(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.release()


def _warm_figures(stats: WarmStats | None) -> dict[str, float | int | None] | None:
    if stats is None:
        return None
    return {
        "idle": stats.idle,
        "hits": stats.hits,
        "misses": stats.misses,
        "hit_rate": stats.hit_rate,
        "made": stats.made,
        "expired": stats.expired,
        "idle_container_seconds": stats.idle_container_seconds,
        "claim_seconds_p50": stats.claim_seconds_p50,
    }


def _checked_routes(routes: Sequence[str]) -> tuple[str, ...]:
    """The relay's extra routes, each checked (ValueError naming a bad one)."""
    if not routes:
        return ()
    from harbor_exec.network.relay import check_extra_route  # the server extra

    return tuple(check_extra_route(route) for route in routes)


def _task_resolver(tasks_path: Path, config: HarborConfig, *, written: list[Path]) -> TaskResolver:
    """The resolver of ``config.tasks``; ``written`` are directories this backend writes."""
    sources = config.tasks
    git = GitTaskSource(
        allow=sources.task_git_allow, allow_unpinned=sources.task_git_allow_unpinned
    )
    packages = sources.package_source
    if isinstance(packages, str):
        packages = PackageSource(packages)
    written = [*written, git.cache_dir]
    if packages is not None:
        written.append(packages.cache_dir)
    return TaskResolver(
        tasks_path,
        task_mode=sources.task_mode,
        task_roots=list(sources.task_roots),
        # Never a task root: a rollout could plant a task there for the next one.
        written_roots=written,
        git=git,
        packages=packages,
        env_allow=sources.task_env_allow,
        # A bundled grader verifies tasks without tests/; known once the bundle is built.
        require_tests=config.agent.grader is None,
    )


class HarborBackend(ExecutionBackend):
    """Runs each rollout as an isolated Docker trial of a Harbor task (see module doc).

    The constructor only reads configuration; ``start()`` (called by the server
    before it serves, or on first use) builds the bundle and opens the executor.
    """

    reports_running = True
    reports_agent_start = True  # when the trial's agent phase begins (see _run)

    def __init__(
        self,
        config: HarborConfig | None = None,
        /,
        *,
        runtime: ContainerEngine | None = None,
        executor: TrialExecutor | None = None,
        **keywords: Unpack[HarborKeywords],
    ) -> None:
        """``HarborBackend(config)``, or osmosis-ai 0.3.8's keywords
        (``HarborBackend(tasks_dir=..., agent=...)``: ``constructor.harbor_config``
        reads them into the one ``HarborConfig``). ``runtime`` or ``executor``: where
        trials run (default: a ``LocalExecutor`` on this machine's engine)."""
        if config is None:
            config = harbor_config(**keywords)
        elif keywords:
            raise TypeError("HarborBackend(config) takes no other settings: put them in config")
        self.config = config
        self.relay_extra_routes = _checked_routes(config.agent.relay_extra_routes)
        tasks_path = config.tasks.tasks_dir.resolve()
        if not tasks_path.is_dir():
            raise ValueError(f"tasks_dir {tasks_path} is not a directory")
        self.native = check_agent_choice(config.agent, deps_in_image=config.sandbox.deps_in_image)
        self.is_oracle = config.agent.agent == "oracle"
        self.max_concurrent_trials = config.capacity.max_concurrent_trials
        self.max_queue_depth = config.capacity.max_queue_depth
        self.cleanup_successful_trials = config.paths.cleanup_successful_trials
        base = Path(tempfile.gettempdir()) / "harbor-exec" / tasks_path.name
        self.trials_dir = config.paths.trials_dir or base / "trials"
        # The same root the server writes trajectories and diagnostics to, by default.
        self.artifacts_dir = config.paths.artifacts_dir or default_artifact_root()
        self.resolver = _task_resolver(
            tasks_path, config, written=[self.trials_dir, self.artifacts_dir]
        )
        agent = config.agent.agent
        self.agent_name = (
            "oracle" if self.is_oracle else str(getattr(agent, "__name__", agent or "bundle"))
        )
        self.package_cache: PackageCacheService | None = None
        self.executor: TrialExecutor = executor or LocalExecutor(runtime)
        self.bundle: PreparedBundle | None = None
        self.planner: TrialPlanner | None = None
        self._start_lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        #: Places taken at admission (``reserve``) until the rollout's task ended
        #: (``release``): capacity only; the server owns every rollout's state.
        self._reserved: set[str] = set()
        self._slots = asyncio.Semaphore(self.max_concurrent_trials)
        self._teardowns = _Teardowns(self.max_concurrent_trials)
        self._blocked: dict[str, str] = {}
        self._shutting_down = False
        self.image_builds = 0  # task images and dependency layers built for this backend
        #: An in-container native agent's layer (mini-swe-agent), prepared at start.
        self.agent_layer: AgentLayer | None = None

    @property
    def tasks_dir(self) -> Path:
        return self.resolver.tasks_dir

    @property
    def task_mode(self) -> TaskMode:
        return self.resolver.task_mode

    # ----------------------------------------------------------------- set-up

    def start(self) -> None:
        with self._start_lock:
            if self.planner is not None:
                return
            if self.native is not None:
                # Harbor's import (litellm's, mostly) takes seconds: now, not in the first
                # rollout, and offline (no cost-map fetch, no tokenizer download).
                set_litellm_offline()
                importlib.import_module("harbor_exec.agents.native.environment")
                if is_in_container_agent(self.native.name):
                    self._prepare_agent_layer(self.native)
            choice = self.config.agent
            bundle_args: dict[str, Any] = {
                "workflow_config": choice.workflow_config,
                "grader": choice.grader,
                "grader_config": choice.grader_config,
                "code_dir": choice.code_dir,
                "bundle": choice.bundle,
                "strict_grader_isolation": choice.strict_grader_isolation,
            }
            if self.native is not None and (choice.grader is not None or choice.bundle is not None):
                # A grader-only bundle: Harbor's agent is no workflow.
                self.bundle = prepare_bundle(None, **bundle_args)
                self.resolver.require_tests = False
            elif not self.is_oracle and self.native is None:
                # agent None: the workflow is the prebuilt bundle's own.
                self.bundle = prepare_bundle(
                    choice.agent, agent_from_bundle=choice.agent is None, **bundle_args
                )
                self.agent_name = self.bundle.name
                self.resolver.require_tests = not self.bundle.has_grader
            cache_config = self.config.package_cache
            if cache_config is not None and self.package_cache is None:
                # None on Ray: each node runs a cache of its own from the config.
                self.package_cache = self.executor.package_cache_service(cache_config)
            sandbox = self.config.sandbox
            if self.native is not None:
                # A grader's dependencies stay in the volume of the verifier's container.
                sandbox = replace(sandbox, deps_in_image=False)
            policy = sandbox.policy(
                max_concurrent_trials=self.max_concurrent_trials,
                pid_max=self.executor.pid_max,
            )
            self.trials_dir.mkdir(parents=True, exist_ok=True)
            self.artifacts_dir.mkdir(parents=True, exist_ok=True)
            self.planner = TrialPlanner(
                bundle=self.bundle,
                policy=policy,
                trials_dir=self.trials_dir,
                relay_extra_routes=self.relay_extra_routes,
                native=self.native,
                prefer_grader=choice.prefer_grader,
                grader_env=self._grader_env(choice),
            )
            if self.bundle is not None and self.bundle.has_grader and not choice.prefer_grader:
                self._say_tests_win()

    def _grader_env(self, choice: AgentChoice) -> dict[str, str]:
        """The values of ``grader_env``'s names, read from this process's environment
        once; refused where the grader would not run in a container of its own."""
        if not choice.grader_env:
            return {}
        if self.bundle is None or not self.bundle.has_grader:
            raise ValueError("grader_env is for a bundled grader: give grader= (or a bundle)")
        if self.config.sandbox.grader_verifier_mode == "shared":
            raise ValueError(
                "grader_env reaches only a grader in a separate verifier container; with "
                "grader_verifier_mode='shared' what the agent left in its container could "
                "read it: drop one of the two"
            )
        missing = [name for name in choice.grader_env if name not in os.environ]
        if missing:
            raise ValueError(
                f"grader_env: {', '.join(missing)} not set in this process's environment"
            )
        return {name: os.environ[name] for name in choice.grader_env}

    def _say_tests_win(self) -> None:
        """A grader is configured, and served tasks with tests of their own verify with
        those (Harbor's rule): say which, and how to have the grader verify them."""
        tasks = self.config.tasks
        root = tasks.tasks_dir
        if tasks.task_mode == "template":
            candidates = [root]
        else:
            candidates = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        with_tests = [p.name for p in candidates if (p / "tests" / "test.sh").is_file()]
        if with_tests:
            shown = ", ".join(with_tests[:5]) + (" ..." if len(with_tests) > 5 else "")
            logger.warning(
                "the grader %s does not verify %d task(s) with a tests/test.sh of their own "
                "(%s): their tests do, as in Harbor. prefer_grader=True (--prefer-grader) has "
                "the grader verify them instead.",
                self.config.agent.grader,
                len(with_tests),
                shown,
            )

    def _prepare_agent_layer(self, native: NativeAgentConfig) -> None:
        """An in-container agent's layer (mini-swe-agent's, opencode's): its wheels and
        binaries fetched now (the only time the network is used), installed into its
        volume by prewarm or the first trial. When they cannot be had, every trial's
        setup fails at once, naming the layer."""
        from harbor_exec.bundler.agent_wheels import prepare_agent_layer
        from harbor_exec.bundler.errors import BundleError

        try:
            self.agent_layer = prepare_agent_layer(native.name)
        except (AgentLayerError, BundleError, OSError) as exc:
            logger.warning("the %s agent layer is not available: %s", native.name, exc)
            return
        self.native = replace(native, layer=self.agent_layer)

    @property
    def policy(self) -> SandboxPolicy:
        self.start()
        assert self.planner is not None
        return self.planner.policy

    # ----------------------------------------------------------------- execute

    async def execute(
        self, request: ExecutionRequest, rollout: RolloutContext | None = None
    ) -> ExecutionOutcome:
        pending = _Pending(task=asyncio.current_task())
        self._pending[request.id] = pending
        admitted = time.monotonic()
        try:
            return await self._execute(request, pending, admitted, rollout_of(request, rollout))
        finally:
            self._pending.pop(request.id, None)

    async def _execute(
        self,
        request: ExecutionRequest,
        pending: _Pending,
        admitted: float,
        context: RolloutContext,
    ) -> ExecutionOutcome:
        if self._shutting_down:
            raise RuntimeError("the Harbor backend is shutting down")
        if self.planner is None:
            await anyio.to_thread.run_sync(self.start)
        assert self.planner is not None
        try:
            resolved = self.resolver.resolve(request)
            if resolved.task_id in self._blocked:
                reason = self._blocked[resolved.task_id]
                raise RolloutRejected(f"task {resolved.task_id!r} failed prewarm: {reason}")
            plan = self.planner.plan(request, resolved, context)
        except RolloutRejected as exc:
            rejected = failure(str(exc), RolloutErrorCategory.VALIDATION_ERROR)
            return ExecutionOutcome(workflow=rejected)
        # The executor's warm pool hears of it: queued behind the slots, or one of a
        # group that said its size (its containers are made while it waits).
        arrival = self.executor.expect(
            plan.trial.task.name, queued=self._slots.locked(), group=group_hint(request.metadata)
        )
        try:
            await self._slots.acquire()
            # Given back once: when the trial's reward is read (its containers' removal
            # is clean-up, the slot the next rollout's), else when the rollout ends.
            slot = _Slot(self._slots, self._teardowns)
            try:
                arrival.took_its_slot()
                pending.started = True
                context.update_status(RolloutStatus.RUNNING)
                return await self._run(request, plan, pending, admitted, context, slot)
            finally:
                slot.end()
        except asyncio.CancelledError:
            if not pending.cancel_requested:
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            return ExecutionOutcome(workflow=cancelled())
        finally:
            arrival.left()

    # ----------------------------------------------------------------- status, cancel

    def rollout_status(self, rollout_id: str) -> dict[str, Any] | None:
        """osmosis-ai's HarborBackend method, for a caller that drives this backend
        without our server: ``{"status": queued|running|grading}`` while the rollout is
        in flight, None otherwise (its result is the server's, which owns it)."""
        pending = self._pending.get(rollout_id)
        if pending is not None:
            if pending.grading:
                return {"status": RolloutStatus.GRADING}
            return {"status": RolloutStatus.RUNNING if pending.started else RolloutStatus.QUEUED}
        if rollout_id in self._reserved:
            return {"status": RolloutStatus.QUEUED}
        return None

    def cancel_rollouts(
        self,
        ids: Sequence[str] | None = None,
        prefix: str | None = None,
        all: bool = False,
    ) -> dict[str, str]:
        """Cancel matching in-flight rollouts (``ids``, or every id with ``prefix``, or
        ``all``): ``cancelled_queued``, ``cancelled_running`` or ``not_found`` (unknown,
        or already finished: idempotent) per rollout, as osmosis-ai 0.3.8 answers."""
        if all:
            selected = list(self._pending)
        elif prefix is not None:
            selected = [rid for rid in self._pending if rid.startswith(prefix)]
        else:
            selected = list(ids or [])
        dispositions: dict[str, str] = {}
        for rollout_id in selected:
            pending = self._pending.get(rollout_id)
            if pending is None or pending.task is None or pending.task.done():
                dispositions[rollout_id] = "not_found"
                continue
            started = pending.started
            self.cancel(rollout_id)
            dispositions[rollout_id] = "cancelled_running" if started else "cancelled_queued"
        return dispositions

    async def _run(
        self,
        request: ExecutionRequest,
        plan: RolloutPlan,
        pending: _Pending,
        admitted: float,
        context: RolloutContext,
        slot: _Slot,
    ) -> ExecutionOutcome:
        loop = asyncio.get_running_loop()

        def on_phase(phase: TrialPhase) -> None:
            # From the trial's thread: the agent phase begins after image, container
            # and set-up, which is when its agent started.
            if phase is TrialPhase.AGENT:
                loop.call_soon_threadsafe(context.record_agent_start, datetime.now(UTC))
            if phase is TrialPhase.VERIFIER:
                pending.grading = True
                loop.call_soon_threadsafe(context.update_status, RolloutStatus.GRADING)
            if phase is TrialPhase.TEARDOWN:
                context.teardown_started_at = datetime.now(UTC)
                loop.call_soon_threadsafe(slot.early)

        trial = plan.trial
        if request.agent_timeout_sec is not None:
            # The deadline counts from admission: time spent queued is the agent's.
            budget = max(request.agent_timeout_sec - (time.monotonic() - admitted), 0.0)
            trial = replace(trial, agent_timeout_sec=budget)
        handle = self.executor.submit(
            trial, secrets=plan.secrets, content=plan.content, on_phase=on_phase
        )
        pending.handle = handle
        if pending.cancel_requested:
            self.executor.cancel(handle)
        try:
            run = await handle.result()
        except asyncio.CancelledError:
            self.executor.cancel(handle)  # frees the container; the trial ends soon
            raise
        except HarborExecError as exc:  # e.g. the cluster lost the trial
            return ExecutionOutcome(workflow=failure(str(exc), category_of(type(exc).__name__)))
        self.image_builds += run.images_built
        outcome = rollout_outcome(request, run, plan.outcome)
        self._archive(request.id, run, plan, success=outcome.result.status is RolloutStatus.SUCCESS)
        return outcome

    def _archive(self, rollout_id: str, run: TrialRun, plan: RolloutPlan, *, success: bool) -> None:
        """Keep the rollout's artifacts (the server writes its diagnostics beside them);
        drop successful trial dirs if asked."""
        target = self.artifacts_dir / rollout_dir_name(rollout_id)
        try:
            produced = run.trial_dir / "artifacts" / "logs" / "artifacts"
            if produced.is_dir() and any(produced.iterdir()):
                target.mkdir(parents=True, exist_ok=True)
                shutil.copytree(produced, target / "artifacts", dirs_exist_ok=True, symlinks=False)
                scrub_tree(target, plan.secrets.scrub)
            atif = run.trial_dir / "agent" / "trajectory.json"  # a native agent's, on the host
            if self.native is not None and atif.is_file() and not atif.is_symlink():
                target.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(atif, target / ATIF_TRAJECTORY)
                scrub_tree(target, plan.secrets.scrub)
            if success and self.cleanup_successful_trials:
                shutil.rmtree(run.trial_dir, ignore_errors=True)
        except OSError:
            logger.warning("could not archive rollout %s", rollout_id, exc_info=True)

    # ----------------------------------------------------------------- control

    def cancel(self, rollout_id: str) -> bool:
        pending = self._pending.get(rollout_id)
        if pending is None or pending.cancel_requested:
            return False
        pending.cancel_requested = True
        if pending.handle is not None:
            self.executor.cancel(pending.handle)
        elif pending.task is not None:
            pending.task.cancel()  # still queued (or planning): execute answers cancelled
        return True

    def _counts(self) -> tuple[int, int]:
        running = sum(1 for p in self._pending.values() if p.started)
        # Admitted rollouts whose execute has not begun yet are queued too.
        reserved = len(self._reserved - self._pending.keys())
        return len(self._pending) - running + reserved, running

    def has_capacity(self) -> bool:
        if self._shutting_down:
            return False
        if self.max_queue_depth is None:
            return True
        # Every running slot plus the queue: counted over all admitted rollouts, so a
        # rollout admitted a moment ago counts before its trial has taken a slot.
        in_flight = len(self._reserved | self._pending.keys())
        return in_flight < self.max_concurrent_trials + self.max_queue_depth

    def reserve(self, rollout_id: str) -> bool:
        if not self.has_capacity():
            return False
        self._reserved.add(rollout_id)
        return True

    def release(self, rollout_id: str) -> None:
        self._reserved.discard(rollout_id)

    def queue_info(self) -> QueueInfo:
        queued, running = self._counts()
        nodes = None
        if isinstance(self.executor, MultiNodeExecutor):
            nodes = [n.slots_only() for n in self.executor.nodes()]
        return QueueInfo(
            queued=queued,
            running=running,
            capacity=self.max_concurrent_trials,
            max_queue_depth=self.max_queue_depth,
            nodes=nodes,
        )

    def unavailable_reason(self) -> str | None:
        return self.executor.available()

    def health(self) -> HarborHealth:
        queued, running = self._counts()
        executor = self.executor.health()
        status = "ok" if executor.available else "degraded"
        return HarborHealth(
            status=status if not self._shutting_down else "shutting_down",
            backend="harbor",
            docker="ok" if executor.available else "unavailable",
            docker_reason=executor.reason,
            agent=self.agent_name,
            task_mode=self.task_mode,
            in_flight=queued + running,
            running=running,
            queued=queued,
            capacity=self.max_concurrent_trials,
            max_queue_depth=self.max_queue_depth,
            images=executor.images,
            image_builds=self.image_builds,
            image_builder=executor.builder,
            nodes=executor.nodes or None,
            blocked_tasks=dict(self._blocked),
            warm_containers=_warm_figures(executor.warm),
        )

    def recover_interrupted(self, rollout_ids: Sequence[str]) -> None:
        """Remove the empty trial directories a killed server left for these rollouts
        (their containers are reaped as dead owners'); trials with a result stay."""
        for rollout_id in rollout_ids:
            pattern = f"{glob.escape(rollout_dir_name(rollout_id))}__*"
            for trial_dir in self.trials_dir.glob(pattern):
                if trial_dir.is_dir() and not (trial_dir / "result.json").is_file():
                    shutil.rmtree(trial_dir, ignore_errors=True)

    # ----------------------------------------------------------------- prewarm

    async def prewarm(
        self, task_ids: list[str] | None = None, *, jobs: int | None = None
    ) -> PrewarmSummary:
        """Build every task image (and the bundle's dependency layer) where trials run,
        up to ``jobs`` tasks at once (default: the engine's CPU count).

        A task that fails is blocked: its rollouts fail at once with the reason; the
        others go on.
        """
        if jobs is not None and jobs < 1:
            raise ValueError(f"prewarm jobs must be at least 1; got {jobs}")
        await anyio.to_thread.run_sync(self.start)
        try:
            candidates = self.resolver.candidates(task_ids)
        except (DatasetError, TaskError) as exc:
            return PrewarmSummary(failed=1, failed_tasks={"*": str(exc)})
        summary = PrewarmSummary(total=len(candidates))
        if jobs is None:
            jobs = await anyio.to_thread.run_sync(self.executor.default_prewarm_jobs)
        limiter = anyio.CapacityLimiter(jobs)
        deps = self.bundle.deps if self.bundle is not None else None

        async def one(task_id: str, path: Path) -> None:
            started = time.monotonic()
            try:
                async with limiter:
                    task = await anyio.to_thread.run_sync(self.resolver.load, path)
                    # The trials' policy: builds go through the package cache when on.
                    built = await self.executor.prewarm(task, deps, self.policy)
                    if self.agent_layer is not None and isinstance(self.executor, LocalExecutor):
                        built += await self.executor.prewarm_agent_layer(
                            task, self.agent_layer, self.policy
                        )
            except (HarborExecError, OSError, ValueError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                summary.failed += 1
                summary.failed_tasks[task_id] = self._blocked[task_id] = reason
                logger.warning("prewarm %s: failed: %s", task_id, reason.splitlines()[0])
                return
            finally:
                summary.seconds[task_id] = round(time.monotonic() - started, 3)
            self._blocked.pop(task_id, None)
            self.image_builds += built
            if built:
                summary.built += 1
            else:
                summary.cached += 1
            status = "built" if built else "cached"
            # Progress for `serve --prewarm`, one line per task as it ends.
            logger.info("prewarm %s: %s in %.1fs", task_id, status, summary.seconds[task_id])

        async with anyio.create_task_group() as group:
            for task_id, path in candidates:
                group.start_soon(one, task_id, path)
        return summary

    def prewarm_lifespan(
        self, task_ids: list[str] | None = None, *, jobs: int | None = None
    ) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
        """An ASGI lifespan that prewarms before serving; a systemic failure stops start-up."""

        @contextlib.asynccontextmanager
        async def lifespan(_app: Any) -> AsyncIterator[None]:
            summary = await self.prewarm(task_ids, jobs=jobs)
            if summary.systemic:
                raise RuntimeError(
                    f"prewarm failed for {summary.failed} of {summary.total} task(s): "
                    f"{summary.failed_tasks}"
                )
            logger.info("prewarm: %s", summary.model_dump(exclude={"seconds"}))
            yield

        return lifespan

    # ----------------------------------------------------------------- shutdown

    async def shutdown(self) -> None:
        """Cancel everything, wait for trials to end, remove every container of ours."""
        self._shutting_down = True
        for rollout_id in list(self._pending):
            self.cancel(rollout_id)
        running = [p.task for p in self._pending.values() if p.task is not None]
        if running:
            await asyncio.wait(running, timeout=30)
        await self.executor.aclose()
        cache, self.package_cache = self.package_cache, None
        if cache is not None:
            await asyncio.to_thread(cache.close)


__all__ = ["HarborBackend", "HarborHealth", "RolloutRejected"]
