"""``HarborBackend``: every rollout is an isolated Docker trial of a Harbor task.

A rollout flows: ``execute`` validates the request and picks the task (template
or dataset mode), waits for a trial slot (``queued`` until then), runs one
``Trial`` in a worker thread (environment, agent, verifier, teardown), and maps
its ``TrialResult`` to the workflow and grader results.

The agent is the ``oracle`` or a bundled ``AgentWorkflow`` (built once by
``bundler``; its dependencies live in a cached image layer FROM the task image,
so a trial only adds the user's small unpacked wheel). The verifier is the
task's own ``tests/test.sh`` when it has one, otherwise the bundled grader
through a generated ``test.sh``. The workflow reaches the model only through a
per-rollout ``ModelRelay`` on a unix socket mounted into its container: it gets
a loopback URL and a token, never the trainer's URL on its own network nor the
real key (which is also scrubbed from everything the trial writes on the host).
Containers never get host networking.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import hashlib
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
import zipfile
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread

from harbor_exec.agents import (
    MANIFEST_PATH,
    RELAY_DIR,
    RELAY_SOCKET,
    USER_CODE_DIR,
    Agent,
    OracleAgent,
    TestsVerifier,
    WorkflowAgent,
    grader_verifier,
)
from harbor_exec.authoring import (
    RolloutContext,
    RolloutErrorCategory,
    RolloutSample,
    RolloutStatus,
    get_rollout_context,
)
from harbor_exec.backends.base import ExecutionBackend, default_artifact_root
from harbor_exec.docker_runtime import DockerRuntime
from harbor_exec.errors import DatasetError, HarborExecError, TaskError
from harbor_exec.protocol import (
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    rollout_dir_name,
)
from harbor_exec.results import TrialResult
from harbor_exec.runtime import LABEL_KIND, ArchiveEntry, ContainerRuntime, Mount, OutputLimits
from harbor_exec.tasks import Task, discover_tasks, load_task, task_dir_for_id, task_fingerprint
from harbor_exec.trials import (
    SandboxPolicy,
    Trial,
    TrialRequest,
    default_pids_limit,
    ensure_task_image,
    scrub_secrets,
)

logger = logging.getLogger(__name__)

TaskMode = Literal["template", "dataset"]
_RETENTION_SEC = 900.0
# Categories for the trial exceptions a rollout can end with.
_CATEGORIES: dict[str, RolloutErrorCategory] = {
    "AgentTimeoutError": RolloutErrorCategory.TIMEOUT,
    "VerifierTimeoutError": RolloutErrorCategory.TIMEOUT,
    "EnvironmentStartTimeoutError": RolloutErrorCategory.TIMEOUT,
    "SandboxBuildFailedError": RolloutErrorCategory.VALIDATION_ERROR,
    "RewardFileNotFoundError": RolloutErrorCategory.VALIDATION_ERROR,
    "RewardFileEmptyError": RolloutErrorCategory.VALIDATION_ERROR,
    "VerifierOutputParseError": RolloutErrorCategory.VALIDATION_ERROR,
    "TaskConfigError": RolloutErrorCategory.VALIDATION_ERROR,
    "GpuUnavailableError": RolloutErrorCategory.VALIDATION_ERROR,
    "FileNotFoundError": RolloutErrorCategory.VALIDATION_ERROR,
    # Infrastructure, not the agent: a trainer may retry these elsewhere.
    "EngineUnavailableError": RolloutErrorCategory.INTERNAL_ERROR,
}
# Exceptions of the verifier phase: the workflow itself succeeded.
_VERIFIER_SIDE = {
    "VerifierTimeoutError",
    "RewardFileNotFoundError",
    "RewardFileEmptyError",
    "VerifierOutputParseError",
    "AddTestsDirError",
}
_AGENT_SIDE = {
    "SandboxBuildFailedError",
    "EnvironmentStartTimeoutError",
    "EnvironmentStartError",
    "AgentSetupError",
    "AgentTimeoutError",
}


class RolloutRejected(ValueError):
    """A request this backend cannot run; becomes a ``validation_error`` naming the field."""


@dataclass
class _Pending:
    rollout_id: str
    task: asyncio.Task[Any] | None = None
    started: bool = False
    grading: bool = False
    trial: Trial | None = None
    cancel_requested: bool = False


@dataclass
class _Plan:
    """What one rollout will run."""

    task: Task
    task_id: str
    agent: Agent
    verifier: TestsVerifier | None
    verify: bool
    image: str | None
    secrets: list[str] = field(default_factory=list)
    relay: Any = None  # the rollout's ModelRelay (workflow agents only)


def _ref_for(obj: Any, *, what: str) -> str | None:
    """``module:attr`` for a class, a ``module:attr`` string, or a module-level instance."""
    if obj is None:
        return None
    if isinstance(obj, str):
        if ":" not in obj:
            raise ValueError(f"{what} must be 'module:attr'; got {obj!r}")
        return obj
    if isinstance(obj, type):
        return f"{obj.__module__}:{obj.__qualname__}"
    # A config instance: find the module-level name it is bound to.
    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is obj:
                return f"{module.__name__}:{name}"
    raise ValueError(
        f"{what}: pass a 'module:attr' string (the bundle imports it inside the container); "
        f"{obj!r} is not a module-level object"
    )


def _project_dir_of(ref: str) -> Path:
    """The first parent of ``ref``'s module file that has a ``pyproject.toml``."""
    import importlib.util

    spec = importlib.util.find_spec(ref.split(":", 1)[0])
    if spec is None or spec.origin is None:
        raise ValueError(f"cannot find the module of {ref!r} on sys.path; pass code_dir=")
    path = Path(spec.origin).resolve()
    for parent in path.parents:
        if (parent / "pyproject.toml").is_file():
            return parent
    raise ValueError(
        f"cannot find the project of {ref!r} (no pyproject.toml above {path}); pass code_dir="
    )


def _instruction_from_prompt(prompt: Sequence[dict[str, Any]]) -> str:
    texts = [m.get("content") for m in prompt if m.get("role") == "user"]
    if texts and all(isinstance(t, str) for t in texts):
        return "\n\n".join(str(t) for t in texts)
    return json.dumps(list(prompt), indent=2)


class HarborBackend(ExecutionBackend):
    """Runs each rollout as an isolated Docker trial of a Harbor task (see module doc)."""

    reports_running = True

    def __init__(
        self,
        *,
        tasks_dir: str | Path,
        task_mode: TaskMode = "template",
        agent: str | type = "oracle",
        workflow_config: Any = None,
        grader: str | type | None = None,
        grader_config: Any = None,
        code_dir: str | Path | None = None,
        bundle: Any = None,
        trials_dir: str | Path | None = None,
        artifacts_dir: str | Path | None = None,
        cleanup_successful_trials: bool = True,
        max_concurrent_trials: int = 4,
        max_queue_depth: int | None = None,
        runtime: ContainerRuntime | None = None,
        task_roots: Sequence[str | Path] = (),
        task_env_allow: Sequence[str] = (),
        verifier_mode: Literal["task", "separate"] = "task",
        default_cpus: float | None = None,
        default_memory_mb: int | None = None,
        pids_limit: int | None = None,
        output_limits: OutputLimits | None = None,
    ) -> None:
        if task_mode not in ("template", "dataset"):
            raise ValueError(f"task_mode must be 'template' or 'dataset'; got {task_mode!r}")
        if max_queue_depth is not None and max_queue_depth < 1:
            raise ValueError("max_queue_depth must be at least 1 (or None for no limit)")
        if max_concurrent_trials < 1:
            raise ValueError("max_concurrent_trials must be at least 1")
        self.tasks_dir = Path(tasks_dir).resolve()
        if not self.tasks_dir.is_dir():
            raise ValueError(f"tasks_dir {self.tasks_dir} is not a directory")
        self.task_mode: TaskMode = task_mode
        self.max_concurrent_trials = max_concurrent_trials
        self.max_queue_depth = max_queue_depth
        self.cleanup_successful_trials = cleanup_successful_trials
        base = Path(tempfile.gettempdir()) / "harbor-exec" / self.tasks_dir.name
        self.trials_dir = Path(trials_dir) if trials_dir else base / "trials"
        # The same root the server writes trajectories and diagnostics to, by default.
        self.artifacts_dir = Path(artifacts_dir) if artifacts_dir else default_artifact_root()
        self.trials_dir.mkdir(parents=True, exist_ok=True)
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        # Where metadata.harbor_task may point: the tasks dir and the operator's roots,
        # never a directory we write into.
        self.task_roots = [self.tasks_dir, *(Path(r).resolve() for r in task_roots)]
        self._written_roots = [self.trials_dir.resolve(), self.artifacts_dir.resolve()]
        self.task_env_allow = frozenset(task_env_allow)
        if verifier_mode not in ("task", "separate"):
            raise ValueError(f"verifier_mode must be 'task' or 'separate'; got {verifier_mode!r}")

        self.is_oracle = agent == "oracle"
        self._bundle: Any = None
        self._bundle_files: list[ArchiveEntry] = []
        self.agent_name = "oracle"
        if not self.is_oracle:
            self._init_bundle(agent, workflow_config, grader, grader_config, code_dir, bundle)
        elif grader is not None:
            raise ValueError("a bundled grader needs a workflow agent (the oracle has no bundle)")
        self.has_grader = self._bundle is not None and self._bundle.manifest.grader is not None

        self.runtime: ContainerRuntime = runtime or DockerRuntime()
        if isinstance(self.runtime, DockerRuntime):
            self.runtime.reap_orphans()
            pid_max = self.runtime.pid_max()
        else:
            pid_max = 32768
        self.policy = SandboxPolicy(
            verifier_mode="separate" if verifier_mode == "separate" else None,
            pids_limit=pids_limit or default_pids_limit(max_concurrent_trials, pid_max),
            default_cpus=default_cpus,
            default_memory_mb=default_memory_mb,
            output=output_limits or OutputLimits(),
        )
        self._pending: dict[str, _Pending] = {}
        self._finished: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        self._slots = asyncio.Semaphore(max_concurrent_trials)
        self._threads = anyio.CapacityLimiter(max_concurrent_trials + 4)
        self._tasks: dict[tuple[Path, bool], tuple[str, Task]] = {}
        self._deps_images: set[str] = set()  # dependency layers known to exist
        # One upstream connection pool for every rollout's relay (made in the event loop).
        self._relay_transport: Any = None
        # One lock per dependency-layer tag: prewarm builds different tasks' layers at once.
        self._deps_locks: dict[str, threading.Lock] = {}
        self._deps_guard = threading.Lock()
        self._blocked: dict[str, str] = {}
        self._shutting_down = False
        self.reap_interval_sec = 5.0
        self._monitor: asyncio.Task[None] | None = None
        self.image_builds = 0  # task images and dependency layers built by this backend
        self._builds_lock = threading.Lock()

    # ----------------------------------------------------------------- bundle

    def _init_bundle(
        self,
        agent: str | type,
        workflow_config: Any,
        grader: Any,
        grader_config: Any,
        code_dir: str | Path | None,
        bundle: Any,
    ) -> None:
        # The bundler extra is only needed for workflows.
        from harbor_exec.bundler import build_bundle

        workflow_ref = _ref_for(agent, what="agent")
        assert workflow_ref is not None
        self.agent_name = workflow_ref
        if bundle is None:
            project = Path(code_dir) if code_dir else _project_dir_of(workflow_ref)
            bundle = build_bundle(
                project,
                workflow=workflow_ref,
                grader=_ref_for(grader, what="grader"),
                workflow_config=_ref_for(workflow_config, what="workflow_config"),
                grader_config=_ref_for(grader_config, what="grader_config"),
            )
        self._bundle = bundle
        files = [ArchiveEntry(MANIFEST_PATH, bundle.manifest_path.read_bytes(), 0o644)]
        with zipfile.ZipFile(bundle.wheel) as wheel:
            for info in wheel.infolist():
                if info.is_dir() or ".dist-info/" in info.filename:
                    continue
                files.append(ArchiveEntry(f"{USER_CODE_DIR}/{info.filename}", wheel.read(info)))
        self._bundle_files = files

    def _deps_image(self, task_image: str) -> str:
        """The dependency layer FROM ``task_image``: a venv with the bundle's wheelhouse."""
        bundle = self._bundle
        key = hashlib.sha256(f"{task_image}\0{bundle.requirements_digest}".encode()).hexdigest()
        tag = f"harbor-exec/deps:{key[:32]}"
        with self._deps_guard:
            lock = self._deps_locks.setdefault(tag, threading.Lock())
        with lock:
            if tag in self._deps_images or self.runtime.image_exists(tag):
                self._deps_images.add(tag)
                return tag
            user = self.runtime.image_user(task_image)
            with tempfile.TemporaryDirectory(prefix="hx-deps-") as scratch:
                context = Path(scratch)
                shutil.copytree(bundle.wheelhouse, context / "wheelhouse")
                (context / "Dockerfile").write_text(
                    _DEPS_DOCKERFILE.format(
                        image=task_image, pip=bundle.manifest.pip_wheel, user=user or "root"
                    )
                )
                result = self.runtime.ensure_image(
                    context_dir=context,
                    tag=tag,
                    timeout_sec=900,
                    labels={LABEL_KIND: "deps"},
                )
            if result.built:
                self._count_build()
            self._deps_images.add(tag)
            return tag

    def _count_build(self) -> None:
        with self._builds_lock:
            self.image_builds += 1

    # ----------------------------------------------------------------- tasks

    def _load(self, path: Path, *, from_request: bool = False) -> Task:
        """The task at ``path``, loaded again (checked and snapshotted) whenever its
        directory changed since the last load."""
        fingerprint = task_fingerprint(path)
        cached = self._tasks.get((path, from_request))
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
        task = load_task(
            path,
            require_tests=not self.has_grader,
            env_allow=self.task_env_allow if from_request else None,
        )
        self._tasks[(path, from_request)] = (fingerprint, task)
        return task

    def _served_task_path(self, ref: str) -> Path:
        """``ref`` resolved inside a served task root, or one refusal that says nothing
        about whether the path exists."""
        refusal = RolloutRejected(f"harbor_task {ref!r} is not under a served task root")
        if "\0" in ref:
            raise refusal
        path = Path(ref).expanduser()
        path = (self.tasks_dir / path if not path.is_absolute() else path).resolve()
        if any(path.is_relative_to(w) for w in self._written_roots):
            raise refusal
        if not any(path.is_relative_to(root) for root in self.task_roots) or not path.is_dir():
            raise refusal
        return path

    def _task_for(self, request: ExecutionRequest) -> tuple[str, Task]:
        metadata = request.metadata or {}
        if self.task_mode == "template":
            task = self._load(self.tasks_dir)
            instruction = _instruction_from_prompt(request.prompt)
            return self.tasks_dir.name, replace(task, instruction=instruction)
        ref = metadata.get("harbor_task")
        if ref is not None:
            if not isinstance(ref, str) or not ref.startswith((".", "/", "~")):
                raise RolloutRejected(
                    f"metadata.harbor_task {ref!r}: only local task paths (starting with '/', "
                    "'.' or '~') are supported"
                )
            return str(ref), self._load(self._served_task_path(ref), from_request=True)
        task_id = metadata.get("harbor_task_id")
        if task_id is None:
            raise RolloutRejected(
                "dataset mode needs metadata.harbor_task_id (a task directory under the "
                "tasks dir) or metadata.harbor_task (a local task path)"
            )
        if not isinstance(task_id, str):
            raise RolloutRejected(f"metadata.harbor_task_id must be a string; got {task_id!r}")
        try:
            path = task_dir_for_id(self.tasks_dir, task_id)
        except DatasetError as exc:
            raise RolloutRejected(f"metadata.{exc}") from None
        if not path.is_dir():
            raise RolloutRejected(
                f"metadata.harbor_task_id {task_id!r}: no such task in {self.tasks_dir}"
            )
        return task_id, self._load(path)

    def _plan(self, request: ExecutionRequest, context: RolloutContext | None) -> _Plan:
        try:
            task_id, task = self._task_for(request)
        except TaskError as exc:
            raise RolloutRejected(str(exc)) from None
        if task_id in self._blocked:
            raise RolloutRejected(f"task {task_id!r} failed prewarm: {self._blocked[task_id]}")
        verify = request.grade
        if verify and not task.has_tests and not self.has_grader:
            raise RolloutRejected(
                f"grade=true but task {task_id!r} has no tests/test.sh and no grader is configured"
            )
        url = context.chat_completions_url if context else ""
        api_key = context.api_key if context else None
        prompt = request.prompt or [{"role": "user", "content": task.instruction}]
        rollout_input: dict[str, Any] = {
            "version": 1,
            "rollout_id": request.id,
            "prompt": prompt,
            "metadata": request.metadata,
            "chat_completions_url": "",
            "api_key": None,
        }
        # The verifier's copy carries the label and never the key. A task's own
        # tests may read it too (template tasks check answers against the label).
        grader_input = json.dumps({**rollout_input, "label": request.label, "api_key": None})
        verifier: TestsVerifier | None = None
        if verify and task.has_tests:
            tests_input = ArchiveEntry("/tests/rollout.json", grader_input.encode(), 0o644)
            verifier = TestsVerifier(task.tests_dir, generated=[tests_input])
        elif verify:
            verifier = grader_verifier(grader_input.encode(), self._bundle_files)
        if self.is_oracle:
            return _Plan(task, task_id, OracleAgent(), verifier, verify, None)
        if not url:
            raise RolloutRejected("chat_completions_url is empty; the workflow needs an endpoint")
        import httpx  # the server extra; workflows need it

        from harbor_exec.relay import ModelRelay

        if self._relay_transport is None:
            self._relay_transport = httpx.AsyncHTTPTransport(retries=1)
        try:
            relay = ModelRelay(
                upstream_url=url,
                api_key=api_key,
                directory=_relay_root() / f"r-{secrets.token_hex(6)}",
                transport=self._relay_transport,
            )
        except ValueError as exc:
            raise RolloutRejected(f"chat_completions_url: {exc}") from None
        # The workflow sees the relay's token as its key and a loopback URL that the
        # runner opens onto the mounted socket.
        rollout_input["api_key"] = relay.token
        rollout_input["relay"] = {"socket": RELAY_SOCKET, "path": relay.path_prefix}
        agent = WorkflowAgent(
            name=self.agent_name,
            version=self._bundle.digest[:12],
            bundle_files=self._bundle_files,
            rollout_input=json.dumps(rollout_input).encode(),
        )
        return _Plan(
            task,
            task_id,
            agent,
            verifier,
            verify,
            image=None,
            secrets=[api_key] if api_key and len(api_key) >= 3 else [],
            relay=relay,
        )

    # ----------------------------------------------------------------- execute

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        context = get_rollout_context()
        pending = _Pending(request.id, task=asyncio.current_task())
        self._pending[request.id] = pending
        admitted = time.monotonic()
        try:
            if self._shutting_down:
                raise RuntimeError("the Harbor backend is shutting down")
            try:
                plan = self._plan(request, context)
            except RolloutRejected as exc:
                rejected = _failure(str(exc), RolloutErrorCategory.VALIDATION_ERROR)
                return self._finish(request.id, ExecutionOutcome(workflow=rejected))
            try:
                async with self._slots:
                    pending.started = True
                    if context is not None:
                        context.update_status(RolloutStatus.RUNNING)
                    outcome = await self._run(request, plan, pending, context, admitted)
            except asyncio.CancelledError:
                if not pending.cancel_requested:
                    raise
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                outcome = ExecutionOutcome(workflow=_cancelled())
            return self._finish(request.id, outcome)
        finally:
            self._pending.pop(request.id, None)

    async def _run(
        self,
        request: ExecutionRequest,
        plan: _Plan,
        pending: _Pending,
        context: RolloutContext | None,
        admitted: float,
    ) -> ExecutionOutcome:
        loop = asyncio.get_running_loop()

        def on_phase(phase: str) -> None:
            if phase == "verifier":
                pending.grading = True
                if context is not None:
                    loop.call_soon_threadsafe(context.update_status, RolloutStatus.GRADING)

        agent_budget = request.agent_timeout_sec
        if agent_budget is not None:
            agent_budget = max(agent_budget - (time.monotonic() - admitted), 0.0)

        def run_trial() -> tuple[TrialResult, Trial]:
            image = plan.image
            if plan.task.dockerfile is not None or plan.task.config.environment.docker_image:
                task_image, built = ensure_task_image(self.runtime, plan.task)
                if built:
                    self._count_build()
                if self._bundle is not None:
                    image = self._deps_image(task_image)
            trial_request = TrialRequest(
                task=plan.task,
                trials_dir=self.trials_dir,
                agent=plan.agent,
                verifier=plan.verifier,
                verify=plan.verify,
                trial_name=f"{rollout_dir_name(request.id)}__{secrets.token_hex(4)[:7]}",
                image=image,
                agent_timeout_sec=agent_budget,
                verifier_timeout_sec=request.grader_timeout_sec,
                rollout_id=request.id,
                secrets=plan.secrets,
                policy=self.policy,
                mounts=mounts,
            )
            trial = Trial(self.runtime, trial_request, on_phase=on_phase)
            pending.trial = trial
            if pending.cancel_requested:
                trial.cancel()
            return trial.run(), trial

        mounts: list[Mount] = []
        async with contextlib.AsyncExitStack() as stack:
            if plan.relay is not None:
                # Open for this rollout's trial only: a leftover process cannot call on.
                await stack.enter_async_context(plan.relay)
                mounts.append(Mount(str(plan.relay.directory), RELAY_DIR, read_only=True))
            try:
                result, trial = await anyio.to_thread.run_sync(
                    run_trial, limiter=self._threads, abandon_on_cancel=True
                )
            except asyncio.CancelledError:
                if pending.trial is not None:
                    pending.trial.cancel()  # frees the container; the worker thread ends soon
                raise
            except HarborExecError as exc:  # the image could not be built or found
                failure = _failure(str(exc), _category(type(exc).__name__))
                return ExecutionOutcome(workflow=failure)
        return self._outcome(request, plan, result, trial)

    # ----------------------------------------------------------------- results

    def _outcome(
        self, request: ExecutionRequest, plan: _Plan, result: TrialResult, trial: Trial
    ) -> ExecutionOutcome:
        exc_type = result.exception_type
        diagnostics = _diagnostics(result, plan, trial)
        if exc_type == "CancelledError":
            return ExecutionOutcome(workflow=_cancelled(diagnostics))
        message = result.exception_info.exception_message if result.exception_info else ""
        workflow, sample = self._workflow_result(
            request, plan, trial, exc_type, message, diagnostics
        )
        if workflow.status is not RolloutStatus.SUCCESS or not plan.verify:
            self._archive(request.id, trial, success=workflow.status is RolloutStatus.SUCCESS)
            return ExecutionOutcome(workflow=workflow)
        grader = self._grader_result(trial, result, sample, exc_type, message, diagnostics)
        self._archive(request.id, trial, success=grader.status is RolloutStatus.SUCCESS)
        return ExecutionOutcome(workflow=workflow, grader=grader)

    def _workflow_result(
        self,
        request: ExecutionRequest,
        plan: _Plan,
        trial: Trial,
        exc_type: str | None,
        message: str,
        diagnostics: dict[str, Any],
    ) -> tuple[ExecutionResult, RolloutSample | None]:
        if exc_type == "AgentTimeoutError":
            limit = trial.request.agent_timeout_sec
            text = f"workflow exceeded its {limit:g}s deadline" if limit is not None else message
            return _failure(text, RolloutErrorCategory.TIMEOUT, diagnostics), None
        if exc_type is not None and (exc_type not in _VERIFIER_SIDE or not plan.verify):
            return _failure(message, _category(exc_type), diagnostics), None
        if self.is_oracle:
            sample = RolloutSample(messages=[], label=request.label)
            return ExecutionResult(
                status=RolloutStatus.SUCCESS, sample=sample, extra_fields=diagnostics
            ), sample
        path = trial.dir / "agent" / "sample.json"
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError):
            tail = _tail(trial.dir / "agent" / "runner.txt")
            return _failure(
                f"the workflow wrote no sample (agent/sample.json); runner output:\n{tail}",
                RolloutErrorCategory.AGENT_ERROR,
                diagnostics,
            ), None
        if "error" in payload:
            error = payload["error"]
            category = RolloutErrorCategory(error.get("category", "agent_error"))
            return _failure(str(error.get("message", "")), category, diagnostics), None
        sample = RolloutSample.model_validate({**payload, "label": request.label, "reward": None})
        if plan.relay is not None:
            usage = plan.relay.usage
            sample.metrics = {
                **sample.metrics,
                "llm_requests": usage.requests,
                "llm_prompt_tokens": usage.prompt_tokens,
                "llm_completion_tokens": usage.completion_tokens,
                "llm_total_tokens": usage.total_tokens,
            }
        return ExecutionResult(
            status=RolloutStatus.SUCCESS, sample=sample, extra_fields=diagnostics
        ), sample

    def _grader_result(
        self,
        trial: Trial,
        result: TrialResult,
        sample: RolloutSample | None,
        exc_type: str | None,
        message: str,
        diagnostics: dict[str, Any],
    ) -> ExecutionResult:
        if exc_type is not None and exc_type != "AgentTimeoutError":
            error_file = trial.dir / "verifier" / "grader_error.json"
            if error_file.is_file():
                with contextlib.suppress(ValueError, OSError, KeyError):
                    error = json.loads(error_file.read_text())["error"]
                    return _failure(
                        f"grader failed: {error['message']}",
                        RolloutErrorCategory(error.get("category", "agent_error")),
                        diagnostics,
                        sample,
                    )
            return _failure(message, _category(exc_type), diagnostics, sample)
        rewards = result.verifier_result.rewards if result.verifier_result else None
        rewards = rewards or {}
        if "reward" in rewards:
            reward = float(rewards["reward"])
        elif len(rewards) == 1:
            reward = float(next(iter(rewards.values())))
        else:
            return _failure(
                f"reward.json has no 'reward' key for the sample (keys: {sorted(rewards)})",
                RolloutErrorCategory.VALIDATION_ERROR,
                diagnostics,
                sample,
            )
        graded = trial.dir / "verifier" / "sample.json"
        if graded.is_file():  # the grader changed the sample: keep everything it decided
            payload = json.loads(graded.read_text())
            label = sample.label if sample else None
            sample = RolloutSample.model_validate({**payload, "label": label})
        if sample is None:
            sample = RolloutSample(messages=[])
        sample = sample.model_copy(deep=True)
        sample.reward = reward
        if len(rewards) > 1:
            sample.metrics = {
                **sample.metrics,
                **{f"reward/{k}": float(v) for k, v in rewards.items()},
            }
        return ExecutionResult(
            status=RolloutStatus.SUCCESS, sample=sample, extra_fields=diagnostics
        )

    def _archive(self, rollout_id: str, trial: Trial, *, success: bool) -> None:
        """Keep the rollout's artifacts (the server writes its diagnostics beside them);
        drop successful trial dirs if asked."""
        target = self.artifacts_dir / rollout_dir_name(rollout_id)
        try:
            target.mkdir(parents=True, exist_ok=True)
            produced = trial.dir / "artifacts" / "logs" / "artifacts"
            if produced.is_dir() and any(produced.iterdir()):
                shutil.copytree(produced, target / "artifacts", dirs_exist_ok=True, symlinks=False)
            if trial.request.secrets:
                scrub_secrets(target, trial.request.secrets)
            if success and self.cleanup_successful_trials:
                shutil.rmtree(trial.dir, ignore_errors=True)
        except OSError:
            logger.warning("could not archive rollout %s", rollout_id, exc_info=True)

    def _finish(self, rollout_id: str, outcome: ExecutionOutcome) -> ExecutionOutcome:
        result = outcome.result
        reward = result.sample.reward if result.sample else None
        now = time.monotonic()
        self._finished[rollout_id] = (
            now,
            {"status": result.status.value, "reward": reward, "err_message": result.err_message},
        )
        while self._finished and next(iter(self._finished.values()))[0] < now - _RETENTION_SEC:
            self._finished.popitem(last=False)
        return outcome

    # ----------------------------------------------------------------- admission and status

    def _counts(self) -> tuple[int, int]:
        running = sum(1 for p in self._pending.values() if p.started)
        return len(self._pending) - running, running

    # ----------------------------------------------------------------- engine health

    def _ensure_monitor(self) -> None:
        """Start the engine watcher on the running loop (once; constructors stay passive)."""
        if self._monitor is not None or self._shutting_down:
            return
        if not isinstance(self.runtime, DockerRuntime):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._monitor = loop.create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        """Reap periodically (owed removals, dead owners' containers), and poll the
        engine quickly while it is down so admissions resume as soon as it is back."""
        runtime = self.runtime
        assert isinstance(runtime, DockerRuntime)
        while not self._shutting_down:
            try:
                await anyio.to_thread.run_sync(runtime.reap)
            except Exception:
                logger.warning("periodic reap failed", exc_info=True)
            await asyncio.sleep(self.reap_interval_sec if runtime.engine_available else 0.5)

    def recover_interrupted(self, rollout_ids: Sequence[str]) -> None:
        """Remove the empty trial directories a killed server left for these rollouts
        (their containers were reaped at start-up); trials with a result stay."""
        for rollout_id in rollout_ids:
            for trial_dir in self.trials_dir.glob(
                f"{glob.escape(rollout_dir_name(rollout_id))}__*"
            ):
                if trial_dir.is_dir() and not (trial_dir / "result.json").is_file():
                    shutil.rmtree(trial_dir, ignore_errors=True)

    def unavailable_reason(self) -> str | None:
        self._ensure_monitor()
        runtime = self.runtime
        if isinstance(runtime, DockerRuntime) and not runtime.engine_available:
            return (
                f"the Docker engine at {runtime.engine_url} is not answering; rollouts are "
                "admitted again as soon as it is back"
            )
        return None

    def has_capacity(self) -> bool:
        if self._shutting_down:
            return False
        queued, _running = self._counts()
        return self.max_queue_depth is None or queued < self.max_queue_depth

    def queue_info(self) -> dict[str, Any]:
        queued, running = self._counts()
        return {
            "queued": queued,
            "running": running,
            "capacity": self.max_concurrent_trials,
            "max_queue_depth": self.max_queue_depth,
        }

    def rollout_status(self, rollout_id: str) -> dict[str, Any] | None:
        pending = self._pending.get(rollout_id)
        if pending is not None:
            status = "grading" if pending.grading else "running" if pending.started else "queued"
            return {"status": status}
        finished = self._finished.get(rollout_id)
        return dict(finished[1]) if finished else None

    def cancel_rollouts(
        self,
        ids: Sequence[str] | None = None,
        prefix: str | None = None,
        all: bool = False,
    ) -> dict[str, str]:
        if all:
            selected = list(self._pending)
        elif prefix is not None:
            selected = [i for i in self._pending if i.startswith(prefix)]
        else:
            selected = list(ids or [])
        dispositions: dict[str, str] = {}
        for rollout_id in selected:
            pending = self._pending.get(rollout_id)
            if pending is None or pending.cancel_requested:
                dispositions[rollout_id] = "not_found"
                continue
            pending.cancel_requested = True
            if pending.started:
                dispositions[rollout_id] = "cancelled_running"
                if pending.trial is not None:
                    # Removing the container takes milliseconds; do it off the event loop.
                    threading.Thread(target=pending.trial.cancel, daemon=True).start()
            else:
                dispositions[rollout_id] = "cancelled_queued"
                if pending.task is not None:
                    pending.task.cancel()
        return dispositions

    def health(self) -> dict[str, Any]:
        queued, running = self._counts()
        images: dict[str, int] = {}
        docker_state = "ok"
        builder = None
        if isinstance(self.runtime, DockerRuntime):
            builder = self.runtime.builder
            self._ensure_monitor()
            try:
                if not self.runtime.engine_available:
                    raise HarborExecError("engine down")
                for info in self.runtime.list_images():
                    images[info.kind or "other"] = images.get(info.kind or "other", 0) + 1
            except HarborExecError:
                docker_state = "unavailable"
        status = "ok" if docker_state == "ok" else "degraded"
        return {
            "status": status if not self._shutting_down else "shutting_down",
            "docker": docker_state,
            "backend": "harbor",
            "agent": self.agent_name,
            "task_mode": self.task_mode,
            "in_flight": queued + running,
            "running": running,
            "queued": queued,
            "capacity": self.max_concurrent_trials,
            "max_queue_depth": self.max_queue_depth,
            "images": images,
            "image_builds": self.image_builds,
            "image_builder": builder,
            "blocked_tasks": dict(self._blocked),
        }

    # ----------------------------------------------------------------- prewarm

    def _prewarm_candidates(self, task_ids: list[str] | None) -> list[tuple[str, Path]]:
        if self.task_mode == "template":
            return [(self.tasks_dir.name, self.tasks_dir)]
        if task_ids is None:
            found = discover_tasks(self.tasks_dir)
            candidates = [(t.path.name, t.path) for t in found.tasks]
            candidates += [(e.task, self.tasks_dir / e.task) for e in found.broken]
            return candidates
        return [(task_id, task_dir_for_id(self.tasks_dir, task_id)) for task_id in task_ids]

    def _prewarm_one(self, path: Path) -> bool:
        """Build what ``path``'s rollouts need; True when something was built."""
        task = self._load(path)
        before = self.image_builds
        image, built = ensure_task_image(self.runtime, task)
        if built:
            self._count_build()
        if self._bundle is not None:
            self._deps_image(image)
        return self.image_builds > before

    def _default_prewarm_jobs(self) -> int:
        if isinstance(self.runtime, DockerRuntime):
            return self.runtime.engine_cpus()
        return os.cpu_count() or 1

    async def prewarm(
        self, task_ids: list[str] | None = None, *, jobs: int | None = None
    ) -> dict[str, Any]:
        """Build every task image (and the bundle's dependency layer) ahead of time,
        up to ``jobs`` tasks at once (default: the engine's CPU count).

        A task that fails is blocked: its rollouts fail at once with the reason; the
        others go on. The summary adds ``seconds`` per task.
        """
        try:
            candidates = self._prewarm_candidates(task_ids)
        except (DatasetError, TaskError) as exc:
            return {
                "total": 0,
                "built": 0,
                "cached": 0,
                "failed": 1,
                "failed_tasks": {"*": str(exc)},
            }
        summary: dict[str, Any] = {
            "total": len(candidates),
            "built": 0,
            "cached": 0,
            "failed": 0,
            "failed_tasks": {},
            "seconds": {},
        }
        if jobs is not None and jobs < 1:
            raise ValueError(f"prewarm jobs must be at least 1; got {jobs}")
        if jobs is None:
            jobs = await anyio.to_thread.run_sync(self._default_prewarm_jobs)
        limiter = anyio.CapacityLimiter(jobs)

        async def one(task_id: str, path: Path) -> None:
            started = time.monotonic()
            try:
                built = await anyio.to_thread.run_sync(self._prewarm_one, path, limiter=limiter)
            except (HarborExecError, OSError, ValueError) as exc:
                summary["failed"] += 1
                summary["failed_tasks"][task_id] = f"{type(exc).__name__}: {exc}"
                self._blocked[task_id] = f"{type(exc).__name__}: {exc}"
                reason = summary["failed_tasks"][task_id].splitlines()[0]
                logger.warning("prewarm %s: failed: %s", task_id, reason)
                return
            finally:
                summary["seconds"][task_id] = round(time.monotonic() - started, 3)
            self._blocked.pop(task_id, None)
            status = "built" if built else "cached"
            summary[status] += 1
            # Progress for `serve --prewarm`, one line per task as it ends.
            logger.info("prewarm %s: %s in %.1fs", task_id, status, summary["seconds"][task_id])

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
            total, failed = summary["total"], summary["failed"]
            if failed and (failed >= total or (total > 1 and failed > total / 2)):
                raise RuntimeError(
                    f"prewarm failed for {failed} of {total} task(s): {summary['failed_tasks']}"
                )
            logger.info("prewarm: %s", summary)
            yield

        return lifespan

    # ----------------------------------------------------------------- shutdown

    async def shutdown(self) -> None:
        """Cancel everything, wait for trials to end, remove every container of ours."""
        self._shutting_down = True
        if self._monitor is not None:
            self._monitor.cancel()
        self.cancel_rollouts(all=True)
        running = [p.task for p in self._pending.values() if p.task is not None]
        if running:
            await asyncio.wait(running, timeout=30)
        if self._relay_transport is not None:
            await self._relay_transport.aclose()
        if isinstance(self.runtime, DockerRuntime):
            left = await anyio.to_thread.run_sync(self.runtime.remove_owned)
            if left:
                print(f"harbor-exec: removed {left} container(s) still running at shutdown")


_DEPS_DOCKERFILE = """\
# harbor-exec dependency layer: the bundle's wheelhouse in a venv, on top of the task image.
FROM {image}
USER root
COPY wheelhouse /opt/harbor-exec/wheelhouse
RUN set -e; \\
    die() {{ echo "harbor-exec: $*" >&2; exit 1; }}; \\
    PY="$(command -v python3 || true)"; \\
    [ -n "$PY" ] || die "this task image has no python3; bundled workflows need Python 3.11+"; \\
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \\
      || die "this task image's python3 is older than 3.11"; \\
    "$PY" -m venv --without-pip /opt/harbor-exec/venv; \\
    wh=/opt/harbor-exec/wheelhouse; \\
    /opt/harbor-exec/venv/bin/python "$wh/{pip}/pip" install --quiet --no-index --no-deps \\
      --no-cache-dir --disable-pip-version-check "$wh"/*.whl; \\
    rm -rf "$wh"
USER {user}
"""


def _relay_root() -> Path:
    """Where rollouts' relay sockets live (short: a socket path has 107 bytes at most)."""
    root = Path(tempfile.gettempdir()) / "hx-relay"
    root.mkdir(mode=0o711, exist_ok=True)
    return root


def _category(exc_type: str | None) -> RolloutErrorCategory:
    return _CATEGORIES.get(exc_type or "", RolloutErrorCategory.AGENT_ERROR)


def _failure(
    message: str,
    category: RolloutErrorCategory,
    diagnostics: dict[str, Any] | None = None,
    sample: RolloutSample | None = None,
) -> ExecutionResult:
    return ExecutionResult(
        status=RolloutStatus.FAILURE,
        sample=sample,
        err_message=message or "rollout failed",
        err_category=category,
        extra_fields=diagnostics,
    )


def _cancelled(diagnostics: dict[str, Any] | None = None) -> ExecutionResult:
    return ExecutionResult(
        status=RolloutStatus.CANCELLED, err_message="cancelled", extra_fields=diagnostics
    )


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def _diagnostics(result: TrialResult, plan: _Plan, trial: Trial) -> dict[str, Any]:
    timings = {
        "environment_setup": result.environment_setup.seconds if result.environment_setup else None,
        "agent_setup": result.agent_setup.seconds if result.agent_setup else None,
        "agent": result.agent_execution.seconds if result.agent_execution else None,
        "verifier": result.verifier.seconds if result.verifier else None,
    }
    if result.started_at and result.finished_at:
        timings["total"] = (result.finished_at - result.started_at).total_seconds()
    phase = (
        "verifier"
        if result.verifier
        else "agent"
        if result.agent_execution
        else "environment_setup"
    )
    exc_type = result.exception_type
    if exc_type in _AGENT_SIDE and phase == "verifier":
        phase = "agent"
    return {
        "backend": "harbor",
        "task": plan.task_id,
        "trial": trial.name,
        "trial_dir": str(trial.dir),
        "phase": phase,
        "harbor_exception_type": exc_type,
        "category": _category(exc_type).value if exc_type else None,
        "rewards": result.verifier_result.rewards if result.verifier_result else None,
        "timings_sec": timings,
    }


__all__ = ["HarborBackend", "RolloutRejected"]
