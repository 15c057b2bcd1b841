"""One trial: environment, agent, verifier, teardown, in Harbor's order and semantics.

A trial is a plain object over a ``ContainerRuntime``: no global state, so it
can run in a thread here or in a Ray actor elsewhere. ``Trial.run`` blocks and
always returns a ``TrialResult`` (also written as ``<trials_dir>/<name>/result.json``);
failures are recorded by Harbor's exception names, never raised.

Order (reference harbor-tasks.md §4), with the calls each step costs:

1. environment: build or reuse the image; create the container; one archive
   upload places ``/logs/{agent,verifier,artifacts}`` (mode 777) and the agent's
   files (``/solution`` for the oracle); start.
2. agent: run under ``[agent].timeout_sec``; on expiry the whole phase is
   killed inside the container, ``AgentTimeoutError`` is recorded, and the trial
   still verifies. A non-zero exit is written to ``agent/exit-code.txt``.
3. verifier: upload ``/tests`` (only now), delete stale reward files, run
   ``test.sh`` under ``[verifier].timeout_sec``; then read the reward.
4. teardown: download ``/logs`` once, remove the container (milliseconds, thanks
   to the init process), write ``result.json``.
"""

from __future__ import annotations

import re
import secrets as secrets_module
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from harbor_exec.agents import Agent, OracleAgent, TestsVerifier, TrialSession, runs_as_root
from harbor_exec.errors import (
    AddTestsDirError,
    AgentTimeoutError,
    CancelledError,
    EngineUnavailableError,
    EnvironmentStartError,
    GpuUnavailableError,
    HarborExecError,
    TrialError,
    VerifierTimeoutError,
    policy_for,
)
from harbor_exec.results import (
    AgentResult,
    ExceptionInfo,
    TimingInfo,
    TrialResult,
    VerifierResult,
    parse_rewards,
    utcnow,
)
from harbor_exec.runtime import (
    LABEL_KIND,
    LABEL_ROLLOUT,
    LABEL_TASK,
    LABEL_TRIAL,
    ArchiveEntry,
    ContainerRuntime,
    ContainerSpec,
    NetworkKind,
    build_archive,
    extract_archive,
    tree_entries,
)
from harbor_exec.tasks import NetworkMode, Task, resolve_env

PhaseCallback = Callable[[str], None]
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")
LOG_DIRS = ("/logs", "/logs/agent", "/logs/verifier", "/logs/artifacts")


def image_tag_for(task: Task) -> str:
    """The content-addressed tag of a task's environment image."""
    return f"harbor-exec/env:{task.environment_digest()[:32]}"


def new_trial_name(task_name: str) -> str:
    """Harbor's shape: ``{task_name[:32]}__{7 random chars}``."""
    stem = _NAME_UNSAFE.sub("-", task_name.split("/")[-1])[:32].rstrip("_-") or "task"
    return f"{stem}__{secrets_module.token_hex(4)[:7]}"


def ensure_task_image(runtime: ContainerRuntime, task: Task) -> tuple[str, bool]:
    """Build (or reuse) the task's image; returns ``(image, built_now)``."""
    env = task.config.environment
    if task.dockerfile is None:
        assert env.docker_image is not None  # load_task guarantees one of the two
        runtime.ensure_present(env.docker_image)
        return env.docker_image, False
    result = runtime.ensure_image(
        context_dir=task.environment_dir,
        tag=image_tag_for(task),
        timeout_sec=env.build_timeout_sec,
        labels={LABEL_KIND: "task-env", LABEL_TASK: task.name},
    )
    return result.tag, result.built


@dataclass
class TrialRequest:
    """Everything one trial needs; plain values only."""

    task: Task
    trials_dir: Path
    agent: Agent = field(default_factory=OracleAgent)
    verifier: TestsVerifier | None = None  # None: the task's own tests/
    verify: bool = True
    trial_name: str | None = None
    source: str | None = None
    image: str | None = None  # run on this image instead of the task's own
    network: NetworkKind | None = None  # override the task's network_mode
    agent_timeout_sec: float | None = None  # override [agent].timeout_sec
    verifier_timeout_sec: float | None = None  # override [verifier].timeout_sec
    extra_files: Sequence[ArchiveEntry] = ()  # placed before start, beside the agent's
    labels: Mapping[str, str] = field(default_factory=dict)
    rollout_id: str | None = None
    secrets: Sequence[str] = ()  # scrubbed from everything written under the trial dir


class Trial:
    """Runs one ``TrialRequest``; ``cancel()`` may be called from any thread."""

    def __init__(
        self,
        runtime: ContainerRuntime,
        request: TrialRequest,
        *,
        on_phase: PhaseCallback | None = None,
    ) -> None:
        self.runtime = runtime
        self.request = request
        self.name = request.trial_name or new_trial_name(request.task.name)
        self.dir = request.trials_dir / self.name
        self.image_built = False
        self._on_phase = on_phase
        self._cancelled = threading.Event()
        self._container_lock = threading.Lock()
        self._container_id: str | None = None
        self._exception: ExceptionInfo | None = None
        self._logs_downloaded = False
        self._current_phase: str | None = None

    # ----------------------------------------------------------------- control

    def cancel(self) -> None:
        """Stop the trial: its container is removed at once; ``run`` records CancelledError."""
        self._cancelled.set()
        with self._container_lock:
            container_id = self._container_id
        if container_id is not None:
            self.runtime.remove(container_id)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise CancelledError("the trial was cancelled")

    def _record(self, exc: BaseException) -> None:
        if self._exception is None:  # Harbor keeps only the first exception
            if isinstance(exc, EngineUnavailableError) and self._current_phase:
                exc = exc.during(self._current_phase)
            self._exception = ExceptionInfo.from_exception(exc)

    def _phase(self, name: str) -> None:
        self._current_phase = name
        if self._on_phase is not None:
            self._on_phase(name)

    # ----------------------------------------------------------------- run

    def run(self) -> TrialResult:
        request, task = self.request, self.request.task
        self.dir.mkdir(parents=True, exist_ok=True)
        result = TrialResult(
            task_name=task.name,
            trial_name=self.name,
            trial_uri=self.dir.resolve().as_uri(),
            task_id={"path": str(task.path)},
            source=request.source,
            task_checksum=task.checksum(),
            config=self._config_summary(),
            agent_info=request.agent.info,
            started_at=utcnow(),
        )
        session: TrialSession | None = None
        try:
            session = self._environment(result)
            if self._exception is None:
                self._agent(session, result)
            if self._should_verify():
                self._verifier(session, result)
        except (HarborExecError, OSError) as exc:
            self._record(exc if not self.cancelled else CancelledError("the trial was cancelled"))
        except BaseException as exc:  # keep the container accounting right on Ctrl-C too
            self._record(CancelledError(f"interrupted: {type(exc).__name__}"))
            self._teardown(session)
            raise
        self._teardown(session)
        self._phase("done")
        result.exception_info = self._exception
        result.finished_at = utcnow()
        self._write(result)
        return result

    def _config_summary(self) -> dict[str, object]:
        request, config = self.request, self.request.task.config
        return {
            "task": {"path": str(request.task.path), "source": request.source},
            "trial_name": self.name,
            "trials_dir": str(request.trials_dir),
            "agent": {"name": request.agent.info.name},
            "timeouts": {
                "agent_sec": request.agent_timeout_sec or config.agent.timeout_sec,
                "verifier_sec": request.verifier_timeout_sec or config.verifier.timeout_sec,
                "build_sec": config.environment.build_timeout_sec,
            },
            "verify": request.verify,
            "rollout_id": request.rollout_id,
        }

    def _network(self) -> NetworkKind:
        if self.request.network is not None:
            return self.request.network
        mode = self.request.task.config.environment.network_mode
        if mode is NetworkMode.NO_NETWORK:
            return "none"
        if mode is NetworkMode.ALLOWLIST:
            raise EnvironmentStartError(
                "[environment].network_mode='allowlist' is not supported by harbor-exec's "
                "Docker runtime; use 'public' or 'no-network'"
            )
        return "bridge"

    def _check_gpus(self) -> int:
        """GPUs to request; ``GpuUnavailableError`` before anything starts when the task
        needs some and the engine has none (Harbor refuses such tasks too)."""
        env = self.request.task.config.environment
        wanted = env.gpus or 0
        if wanted <= 0:
            return 0
        # Runtimes without GPU support (fakes, other engines) report none.
        count_gpus = getattr(self.runtime, "gpu_count", None)
        available = int(count_gpus()) if callable(count_gpus) else 0
        if available == 0 or 0 < available < wanted:
            types = f" of type {', '.join(env.gpu_types)}" if env.gpu_types else ""
            raise GpuUnavailableError(
                f"task {self.request.task.name}: [environment].gpus = {wanted}{types} but the "
                f"Docker engine has {available if available > 0 else 'no'} GPU(s) to give "
                "(install the NVIDIA container toolkit, or run this task elsewhere)"
            )
        return wanted

    def _environment(self, result: TrialResult) -> TrialSession:
        request, task = self.request, self.request.task
        env_config = task.config.environment
        self._phase("environment")
        timing = result.environment_setup = TimingInfo(started_at=utcnow())
        try:
            gpus = self._check_gpus()
            if request.image is not None:
                image = request.image
            else:
                image, self.image_built = ensure_task_image(self.runtime, task)
            self._check_cancelled()
            spec = ContainerSpec(
                image=image,
                name=f"hx-{_NAME_UNSAFE.sub('-', self.name)}-{secrets_module.token_hex(3)}",
                labels={
                    **request.labels,
                    LABEL_TRIAL: self.name,
                    LABEL_TASK: task.name,
                    LABEL_KIND: "trial",
                    **({LABEL_ROLLOUT: request.rollout_id} if request.rollout_id else {}),
                },
                env=resolve_env(env_config.env, task=task.name, field="[environment].env"),
                cpus=float(env_config.cpus) if env_config.cpus else None,
                memory_mb=env_config.memory_mb,
                network=self._network(),
                gpus=gpus,
            )
            with self._container_lock:
                self._check_cancelled()
                self._container_id = self.runtime.create(spec)
            entries = [ArchiveEntry(path, None, 0o777) for path in LOG_DIRS]
            entries += request.agent.files(task)
            entries += request.extra_files
            if task.dockerfile is None and task.environment_dir.is_dir():
                # Harbor uploads environment/ into the workdir for prebuilt images.
                workdir = env_config.workdir or "/"
                entries += tree_entries(task.environment_dir, workdir.rstrip("/") or "/")
            archive = build_archive(entries)
            if runs_as_root(task.config.agent.user):
                # The agent's first command carries these files on its stdin (one fewer call).
                pending: bytes | None = archive
            else:
                self.runtime.put_archive(self._container_id, archive)
                pending = None
            self.runtime.start(self._container_id)
            self._check_cancelled()
        finally:
            timing.finished_at = utcnow()
        return TrialSession(self.runtime, self._container_id, task, pending_files=pending)

    def _agent(self, session: TrialSession, result: TrialResult) -> None:
        request = self.request
        now = utcnow()
        result.agent_setup = TimingInfo(started_at=now, finished_at=now)
        timeout = request.agent_timeout_sec
        if timeout is None:
            timeout = request.task.config.agent.timeout_sec
        self._phase("agent")
        timing = result.agent_execution = TimingInfo(started_at=utcnow())
        try:
            run = request.agent.run(session, timeout)
        finally:
            timing.finished_at = utcnow()
        self._check_cancelled()
        result.agent_result = AgentResult()
        if run.timed_out:
            self._record(
                AgentTimeoutError(
                    f"the agent ran past its {timeout:g}s timeout; its processes were killed "
                    "and the trial was verified anyway"
                )
            )
        if run.exit_code not in (0, None) and not run.timed_out:
            (self.dir / "agent").mkdir(parents=True, exist_ok=True)
            (self.dir / "agent" / "exit-code.txt").write_text(f"{run.exit_code}\n")

    def _should_verify(self) -> bool:
        if not self.request.verify or self._container_id is None or self.cancelled:
            return False
        if self._exception is None:
            return True
        return policy_for(self._exception.exception_type).should_grade

    def _verifier(self, session: TrialSession, result: TrialResult) -> None:
        request, task = self.request, self.request.task
        verifier = request.verifier or TestsVerifier(task.tests_dir)
        timeout = request.verifier_timeout_sec
        if timeout is None:
            timeout = task.config.verifier.timeout_sec
        self._phase("verifier")
        timing = result.verifier = TimingInfo(started_at=utcnow())
        try:
            remaining = None if timeout is None else timeout - _elapsed(timing.started_at)
            run = verifier.run(session, remaining)
            self._check_cancelled()
            if run.timed_out:
                raise VerifierTimeoutError(
                    f"tests/test.sh ran past the {timeout:g}s verifier timeout; no reward"
                )
            if run.upload_failed:
                raise AddTestsDirError("uploading tests/ to /tests in the container failed")
            if run.logs:
                self._store_logs(run.logs)
            else:
                self._download_logs(session.container_id)
            result.verifier_result = VerifierResult(rewards=parse_rewards(self.dir / "verifier"))
        except TrialError as exc:
            self._record(exc)
        finally:
            timing.finished_at = utcnow()

    # ----------------------------------------------------------------- teardown

    def _download_logs(self, container_id: str) -> None:
        """Download ``/logs`` once, into ``agent/``, ``verifier/`` and ``artifacts/``."""
        data = self.runtime.get_archive(container_id, "/logs")
        if data is not None:
            self._store_logs(data)

    def _store_logs(self, data: bytes) -> None:
        """Unpack a tar of ``/logs`` into the trial directory (Harbor's layout)."""
        staging = self.dir / ".logs"
        extract_archive(data, staging)
        for name, target in (
            ("agent", self.dir / "agent"),
            ("verifier", self.dir / "verifier"),
            ("artifacts", self.dir / "artifacts" / "logs" / "artifacts"),
        ):
            source = staging / name
            if source.is_dir():
                _merge_tree(source, target)
        _remove_tree(staging)
        self._logs_downloaded = True

    def _teardown(self, session: TrialSession | None) -> None:
        with self._container_lock:
            container_id, self._container_id = self._container_id, None
        if container_id is None:
            return
        try:
            if not self.cancelled and not self._logs_downloaded:
                self._download_logs(container_id)
        except (HarborExecError, OSError):
            pass  # logs are best effort once the trial is over
        finally:
            try:
                # Teardown never raises: an engine fault leaves the id with the
                # runtime, whose periodic reap removes it once the engine is back.
                self.runtime.remove(container_id)
            except Exception as exc:
                self._record(exc)

    def _write(self, result: TrialResult) -> None:
        if self._exception is not None:
            (self.dir / "exception.txt").write_text(self._exception.exception_traceback)
        result.write(self.dir)
        if self.request.secrets:
            scrub_secrets(self.dir, self.request.secrets)


def _elapsed(since: datetime | None) -> float:
    return 0.0 if since is None else (utcnow() - since).total_seconds()


def _merge_tree(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        destination = target / path.name
        if path.is_dir():
            _merge_tree(path, destination)
        else:
            path.replace(destination)


def _remove_tree(path: Path) -> None:
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


def scrub_secrets(root: Path, secrets: Sequence[str]) -> None:
    """Replace every occurrence of each secret with ``[REDACTED]`` in files under ``root``.

    A file that cannot be rewritten is deleted: a secret must never stay on disk.
    """
    needles = [s.encode() for s in secrets if s]
    if not needles:
        return
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        try:
            data = path.read_bytes()
            scrubbed = data
            for needle in needles:
                scrubbed = scrubbed.replace(needle, b"[REDACTED]")
            if scrubbed != data:
                path.write_bytes(scrubbed)
        except OSError:
            path.unlink(missing_ok=True)


def run_trial(
    runtime: ContainerRuntime,
    request: TrialRequest,
    *,
    on_phase: PhaseCallback | None = None,
) -> TrialResult:
    """Run one trial to completion (see ``Trial``)."""
    return Trial(runtime, request, on_phase=on_phase).run()


__all__ = [
    "Trial",
    "TrialRequest",
    "ensure_task_image",
    "image_tag_for",
    "new_trial_name",
    "run_trial",
    "scrub_secrets",
]
