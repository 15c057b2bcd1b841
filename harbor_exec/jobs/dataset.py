"""Dataset runs: every task x attempt as a trial, with events for a progress display
and Harbor's job ``result.json`` (mean over valid rewards, pass@k, exception_stats).

``run_job`` blocks; it runs trials on a thread pool of ``n_concurrent`` workers.
A ``KeyboardInterrupt`` (Ctrl-C) cancels every running trial, which removes its
container at once, records the rest as cancelled, writes the job result and
re-raises, so nothing is left behind.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from harbor_exec.errors import (
    CancelledError,
    HarborExecError,
    TaskError,
    TrialPhase,
    is_exception,
    policy_for,
)
from harbor_exec.executors.spec import TrialSecrets, trial_request
from harbor_exec.jobs.ahead import RunSlots, Turn
from harbor_exec.sandbox.runtime import ContainerRuntime
from harbor_exec.tasks.task import Task
from harbor_exec.trial.factory import create_trial
from harbor_exec.trial.policy import ContainerLimits
from harbor_exec.trial.results import AgentResult, ExceptionInfo, TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import Trial, new_trial_name

if TYPE_CHECKING:
    from harbor_exec.executors.base import TrialExecutor, TrialHandle
    from harbor_exec.network.packages.service import PackageCacheService
    from harbor_exec.network.usage import ModelUsage


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, else None (stats must never raise on odd rewards)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def is_full_reward(result: TrialResult) -> bool:
    """Passed: the ``reward`` key is >= 1.0 (trainers read only that key); without a
    ``reward`` key, every key is >= 1.0. The reward must be valid, and the trial free
    of exceptions (the oracle without ``solve.sh`` is still verified, as in Harbor,
    and may earn its tests' reward; it did not pass)."""
    if result.first_exception is not None:
        return False
    if not result.reward_valid or result.verifier_result is None:
        return False
    rewards = result.verifier_result.rewards or {}
    if "reward" in rewards:
        rewards = {"reward": rewards["reward"]}
    return bool(rewards) and all((_finite(v) or 0.0) >= 1.0 for v in rewards.values())


def no_scalar_reward(result: TrialResult) -> str | None:
    """Why a trainer cannot use this trial's reward, or None: its verifier wrote rewards
    without a ``reward`` key (a trainer, and ``serve``, read only that key)."""
    rewards = result.verifier_result.rewards if result.verifier_result else None
    if not rewards or "reward" in rewards:
        return None
    return f"no `reward` key (its keys: {', '.join(sorted(rewards))})"


def failure_reason(result: TrialResult) -> str | None:
    """A one-line reason a trial missed full reward, in the user's terms."""
    if is_full_reward(result):
        return None
    if result.first_exception is not None:
        lines = result.first_exception.exception_message.strip().splitlines()
        return f"{result.exception_type}: {lines[0] if lines else ''}"
    rewards = result.verifier_result.rewards if result.verifier_result else None
    rewards = rewards or {}
    rule = "the reward key" if "reward" in rewards else "every key"
    return f"wrong reward {rewards} (full reward is 1.0 for {rule})"


# --------------------------------------------------------------------------- Harbor stats


class AgentDatasetStats(BaseModel):
    n_trials: int = 0
    n_errors: int = 0
    metrics: list[dict[str, float]] = Field(default_factory=list)
    pass_at_k: dict[int, float] = Field(default_factory=dict)
    reward_stats: dict[str, dict[str, list[str]]] = Field(default_factory=dict)
    exception_stats: dict[str, list[str]] = Field(default_factory=dict)


class JobStats(BaseModel):
    n_completed_trials: int = 0
    n_errored_trials: int = 0
    n_running_trials: int = 0
    n_pending_trials: int = 0
    n_cancelled_trials: int = 0
    n_retries: int = 0
    evals: dict[str, AgentDatasetStats] = Field(default_factory=dict)
    n_input_tokens: int | None = None
    n_cache_tokens: int | None = None
    n_output_tokens: int | None = None
    cost_usd: float | None = None


class JobResult(BaseModel):
    """Harbor's job ``result.json`` (times are naive local time, as Harbor writes them)."""

    id: uuid.UUID = Field(default_factory=uuid.uuid4)
    started_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None
    n_total_trials: int
    stats: JobStats
    invalid_tasks: dict[str, str] = Field(default_factory=dict)  # ours: tasks that failed to load


def mean_metric(rewards: Sequence[dict[str, float | int]]) -> dict[str, float]:
    """Harbor's Mean: one key averages as ``mean``; several keys average each (missing = 0)."""
    keys = sorted({key for reward in rewards for key in reward})
    if not rewards:
        return {}
    if len(keys) <= 1:
        values = [_finite(next(iter(r.values()), 0)) or 0.0 for r in rewards]
        return {"mean": sum(values) / len(values)}
    return {k: sum(_finite(r.get(k, 0)) or 0.0 for r in rewards) / len(rewards) for k in keys}


def _pass_at_k_for_task(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(k):
        product *= (n - c - i) / (n - i)
    return 1.0 - product


def pass_at_k(results: Sequence[TrialResult]) -> dict[int, float]:
    """Harbor's pass@k: only when every valid reward is a single 0/1 value."""
    successes: dict[str, list[int]] = defaultdict(list)
    for result in results:
        if not result.reward_valid or result.verifier_result is None:
            continue
        rewards = result.verifier_result.rewards or {}
        if len(rewards) != 1:
            return {}
        value = next(iter(rewards.values()))
        if value not in (0, 1):
            return {}
        successes[result.task_name].append(int(value))
    if not successes:
        return {}
    max_k = min(len(s) for s in successes.values())
    ks = {k for k in (2**i for i in range(1, 64)) if k <= max_k} | set(range(5, max_k + 1, 5))
    return {
        k: sum(_pass_at_k_for_task(len(s), sum(s), k) for s in successes.values()) / len(successes)
        for k in sorted(ks)
    }


def evals_key(agent: str, model: str | None, dataset: str) -> str:
    """Harbor's key of a job's ``stats.evals``: ``agent__model__dataset`` (or
    ``agent__dataset`` without a model)."""
    return f"{agent}__{model}__{dataset}" if model else f"{agent}__{dataset}"


def _add(total: float | None, value: float | None) -> float | None:
    return total if value is None else (total or 0) + value


def _add_int(total: int | None, value: int | None) -> int | None:
    return total if value is None else (total or 0) + value


def job_stats(
    results: Sequence[TrialResult], *, dataset: str, agent: str, model: str | None = None
) -> JobStats:
    stats = JobStats()
    evals = AgentDatasetStats()
    valid_rewards: list[dict[str, float | int]] = []
    for result in results:
        stats.n_completed_trials += 1
        if result.reward_valid and result.verifier_result and result.verifier_result.rewards:
            evals.n_trials += 1
            valid_rewards.append(result.verifier_result.rewards)
            for key, value in result.verifier_result.rewards.items():
                number = _finite(value)
                shown = "invalid" if number is None else str(value)
                evals.reward_stats.setdefault(key, {}).setdefault(shown, []).append(
                    result.trial_name
                )
        usages = (
            [result.agent_result]
            if result.agent_result is not None
            else [s.agent_result for s in result.step_results or [] if s.agent_result]
        )
        for usage in usages:  # summed as Harbor sums them (None: nobody counted)
            stats.n_input_tokens = _add_int(stats.n_input_tokens, usage.n_input_tokens)
            stats.n_cache_tokens = _add_int(stats.n_cache_tokens, usage.n_cache_tokens)
            stats.n_output_tokens = _add_int(stats.n_output_tokens, usage.n_output_tokens)
            stats.cost_usd = _add(stats.cost_usd, usage.cost_usd)
        # Harbor counts every recorded exception's type once (a multi-step trial's
        # are its steps').
        exception_types = sorted({e.exception_type for e in result.recorded_exceptions()})
        for exception_type in exception_types:
            evals.exception_stats.setdefault(exception_type, []).append(result.trial_name)
        if exception_types:
            evals.n_errors += 1
            stats.n_errored_trials += 1
            if any(is_exception(t, CancelledError) for t in exception_types):
                stats.n_cancelled_trials += 1
    evals.metrics = [mean_metric(valid_rewards)] if valid_rewards else []
    evals.pass_at_k = pass_at_k(results)
    stats.evals[evals_key(agent, model, dataset)] = evals
    return stats


# --------------------------------------------------------------------------- running


#: ``--max-retries``' backoff (Harbor's RetryConfig defaults).
RETRY_MIN_WAIT_SEC = 1.0
RETRY_MAX_WAIT_SEC = 60.0


@dataclass
class JobEvent:
    """A progress event: a trial was queued, changed phase, or finished."""

    kind: str  # "queued" | "phase" | "retry" (a failed trial runs again) | "finished"
    task: Task
    attempt: int
    phase: TrialPhase | None = None
    result: TrialResult | None = None


@dataclass
class JobOutcome:
    job_dir: Path
    results: list[TrialResult]
    invalid_tasks: list[TaskError]
    images_built: int
    job_result: JobResult
    interrupted: bool = False
    tasks: list[Task] = field(default_factory=list)
    reused: int = 0  # finished trials kept from an earlier run of the same job

    @property
    def all_passed(self) -> bool:
        if self.invalid_tasks or self.interrupted or not self.results:
            return False
        return all(is_full_reward(r) for r in self.results)


# --------------------------------------------------------------------------- resume


class JobResumeError(HarborExecError):
    """An existing job directory was asked to resume with a different dataset or options."""


JOB_META = "harbor-exec-job.json"  # ours: what a resume must match
#: Harbor's ``AgentConfig`` of the oracle (a job's agent unless it names another).
ORACLE_CONFIG: Mapping[str, Any] = {"name": "oracle"}


def harbor_job_config(
    job_dir: Path,
    *,
    dataset_path: Path | None,
    n_attempts: int,
    n_concurrent: int,
    agent: Mapping[str, Any] = ORACLE_CONFIG,
    dataset_config: Mapping[str, Any] | None = None,
    tasks_config: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Harbor 0.26's job ``config.json`` (JobConfig; unset fields take its defaults);
    ``agent``: Harbor's ``AgentConfig`` fields of the job's agent (never a key);
    ``tasks_config``: its ``tasks`` entries (a package task: name, ref, digest)."""
    config: dict[str, Any] = {
        "schema_version": 1,
        "job_name": job_dir.name,
        "jobs_dir": str(job_dir.parent),
        "n_attempts": n_attempts,
        "n_concurrent_trials": n_concurrent,
        "environment": {"type": "docker", "delete": True},
        "agents": [dict(agent)],
        "datasets": (
            [dict(dataset_config)]
            if dataset_config is not None
            else [{"path": str(dataset_path)}]
            if dataset_path is not None
            else []
        ),
    }
    if tasks_config:
        config["tasks"] = [dict(entry) for entry in tasks_config]
    return config


def harbor_trial_config(
    task: Task, trial_dir: Path, job_id: uuid.UUID, agent: Mapping[str, Any] = ORACLE_CONFIG
) -> dict[str, Any]:
    """Harbor 0.26's per-trial ``config.json`` (TrialConfig)."""
    origin = task.origin or {}
    task_config: dict[str, Any] = (
        {"name": f"{origin['org']}/{origin['name']}", "ref": origin.get("ref"), "source": None}
        if "org" in origin  # a package task: Harbor's TaskConfig names it, with no path
        else {"path": str(task.path), "source": None}
    )
    return {
        "schema_version": 1,
        "task": task_config,
        "trial_name": trial_dir.name,
        "trials_dir": str(trial_dir.parent),
        "agent": dict(agent),
        "environment": {"type": "docker", "delete": True},
        "job_id": str(job_id),
    }


def _job_meta(
    tasks: Sequence[Task], n_attempts: int, dataset_path: Path | None, agent: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "dataset": str(dataset_path) if dataset_path is not None else None,
        "n_attempts": n_attempts,
        "agent": dict(agent),
        "tasks": {task.name: task.checksum() for task in tasks},
    }


def _check_resume(job_dir: Path, meta: dict[str, Any]) -> uuid.UUID | None:
    """The job id to keep when ``job_dir`` is a job to resume (None: a new job);
    ``JobResumeError`` saying what changed when it may not be resumed."""
    meta_path = job_dir / JOB_META
    if not meta_path.is_file():
        if any(job_dir.iterdir()):
            raise JobResumeError(
                f"{job_dir} exists but is not a harbor-exec job (no {JOB_META}); "
                "choose another --job-name"
            )
        return None
    try:
        old = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise JobResumeError(
            f"cannot resume {job_dir}: {meta_path} is unreadable ({exc})"
        ) from None
    changes: list[str] = []
    if old.get("dataset") != meta["dataset"]:
        changes.append(f"the dataset path changed ({old.get('dataset')} -> {meta['dataset']})")
    if old.get("n_attempts") != meta["n_attempts"]:
        changes.append(f"--n-attempts changed ({old.get('n_attempts')} -> {meta['n_attempts']})")
    old_agent = old.get("agent", dict(ORACLE_CONFIG))  # jobs written before agents had one
    if old_agent != meta["agent"]:
        changes.append(
            f"the agent changed ({_shown_agent(old_agent)} -> {_shown_agent(meta['agent'])})"
        )
    old_tasks: dict[str, str] = old.get("tasks") or {}
    added = sorted(set(meta["tasks"]) - set(old_tasks))
    removed = sorted(set(old_tasks) - set(meta["tasks"]))
    edited = sorted(
        name
        for name in set(meta["tasks"]) & set(old_tasks)
        if meta["tasks"][name] != old_tasks[name]
    )
    for what, names in (("added", added), ("removed", removed), ("changed", edited)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            changes.append(f"task(s) {what}: {shown}")
    if changes:
        raise JobResumeError(
            f"cannot resume job {job_dir.name}: "
            + "; ".join(changes)
            + ". Use a new --job-name to start a fresh job."
        )
    try:
        return uuid.UUID(str(old.get("job_id")))
    except ValueError:
        return None


def _shown_agent(agent: Any) -> str:
    if not isinstance(agent, Mapping):
        return repr(agent)
    shown = str(agent.get("name"))
    if agent.get("model_name"):
        shown += f" on {agent['model_name']}"
    return shown + (f" with {dict(agent['kwargs'])}" if agent.get("kwargs") else "")


def _finished_trials(job_dir: Path) -> list[TrialResult]:
    """Trials of a previous run to keep: those with a ``result.json`` that were not
    cancelled. Every other trial directory is removed so that it runs again."""
    kept: list[TrialResult] = []
    for trial_dir in sorted(p for p in job_dir.iterdir() if p.is_dir()):
        result_path = trial_dir / "result.json"
        result: TrialResult | None = None
        if result_path.is_file():
            try:
                result = TrialResult.model_validate_json(result_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                result = None
        if result is not None and not is_exception(result.exception_type, CancelledError):
            kept.append(result)
        else:
            shutil.rmtree(trial_dir, ignore_errors=True)
    return kept


def run_job(
    runtime: ContainerRuntime | None,
    tasks: Sequence[Task],
    *,
    jobs_dir: Path,
    job_name: str | None = None,
    n_concurrent: int = 4,
    n_attempts: int = 1,
    dataset_name: str = "adhoc",
    dataset_path: Path | None = None,
    dataset_config: Mapping[str, Any] | None = None,
    tasks_config: Sequence[Mapping[str, Any]] | None = None,
    invalid_tasks: Sequence[TaskError] = (),
    make_spec: Callable[[Task, Path], TrialSpec] | None = None,
    on_event: Callable[[JobEvent], None] | None = None,
    executor: TrialExecutor | None = None,
    agent: Mapping[str, Any] = ORACLE_CONFIG,
    make_secrets: Callable[[TrialSpec], TrialSecrets] | None = None,
    package_cache: PackageCacheService | None = None,
    max_retries: int = 0,
) -> JobOutcome:
    """Run every task ``n_attempts`` times, ``n_concurrent`` at once; write the job dir.

    ``max_retries``: a trial that ended with an exception Harbor's policy retries
    (``errors.POLICIES``: a build failure, an engine fault, ...) runs again as a new
    trial, up to this many times, 1 s, 2 s, 4 s ... (at most 60 s) apart; the last one
    counts.

    ``package_cache``: this machine's package cache for the trials run here (with an
    executor, the executor's own: ``TrialExecutor.package_cache_service``).

    ``make_spec`` makes each trial (default: the oracle); ``agent`` is its agent as
    Harbor's ``AgentConfig`` names it (``config.json``, and what a resume must match).

    An existing ``jobs_dir/job_name`` is resumed, as Harbor does: finished trials are
    kept and only the rest run; a changed dataset, agent or ``n_attempts`` raises
    ``JobResumeError`` naming what changed.

    With ``executor`` (e.g. a ``RayExecutor``, or a ``LocalExecutor``), trials go
    through it instead of running against ``runtime`` on this machine; the job closes
    it at the end. ``make_secrets`` (with an executor only) gives each trial its
    secrets, e.g. a native agent's model endpoint: the executor opens that trial's
    relay in front of it, and what the relay counted becomes the trial's
    ``agent_result`` (the agent's own counts kept beside them).
    """
    if make_secrets is not None and executor is None:
        raise ValueError("make_secrets needs an executor (it opens each trial's relay)")
    started = datetime.now()
    job_dir = jobs_dir / (job_name or started.strftime("%Y-%m-%d__%H-%M-%S"))
    job_dir.mkdir(parents=True, exist_ok=True)
    meta = _job_meta(tasks, n_attempts, dataset_path, agent)
    job_id = _check_resume(job_dir, meta) or uuid.uuid4()
    kept = _finished_trials(job_dir)
    (job_dir / JOB_META).write_text(json.dumps({**meta, "job_id": str(job_id)}, indent=2))
    (job_dir / "config.json").write_text(
        json.dumps(
            harbor_job_config(
                job_dir,
                dataset_path=dataset_path,
                n_attempts=n_attempts,
                n_concurrent=n_concurrent,
                agent=agent,
                dataset_config=dataset_config,
                tasks_config=tasks_config,
            ),
            indent=2,
        )
    )
    emit = on_event or (lambda event: None)
    done_per_task: dict[str, int] = defaultdict(int)
    for result in kept:
        done_per_task[result.task_name] += 1
    plan: list[tuple[Task, int]] = []
    for attempt in range(n_attempts):
        for task in tasks:
            if attempt >= done_per_task[task.name]:
                plan.append((task, attempt))
    for task, attempt in plan:
        emit(JobEvent("queued", task, attempt))

    lock = threading.Lock()
    active: set[Trial] = set()
    stopping = threading.Event()
    results: list[TrialResult] = list(kept)
    built = 0

    loop: asyncio.AbstractEventLoop | None = None
    remote: set[TrialHandle] = set()
    if executor is not None:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="hx-executor", daemon=True).start()

    def run_remote(
        task: Task, attempt: int, spec: TrialSpec, turn: Turn | None
    ) -> TrialResult | None:
        nonlocal built
        assert executor is not None and loop is not None
        trial_name = spec.trial_name or new_trial_name(task.name)
        spec = replace(spec, trial_name=trial_name)
        trial_dir = job_dir / trial_name
        trial_dir.mkdir(parents=True, exist_ok=True)
        (trial_dir / "config.json").write_text(
            json.dumps(harbor_trial_config(task, trial_dir, job_id, agent), indent=2)
        )
        secrets = make_secrets(spec) if make_secrets is not None else None

        async def go() -> TrialResult:
            handle = executor.submit(
                spec,
                secrets=secrets,
                on_phase=lambda phase: emit(JobEvent("phase", task, attempt, phase=phase)),
                wait_turn=turn.wait if turn is not None else None,
            )
            with lock:
                remote.add(handle)
            try:
                run = await handle.result()
            except HarborExecError as exc:  # the executor lost the trial (e.g. a Ray node)
                result = TrialResult(
                    task_name=task.name,
                    trial_name=handle.name,
                    trial_uri=trial_dir.resolve().as_uri(),
                    task_id=task.origin or {"path": str(task.path)},
                    source=spec.source,
                    task_checksum=task.checksum(),
                    config={},
                    agent_info=spec.agent.info,
                    exception_info=ExceptionInfo.from_exception(exc),
                )
                result.write(trial_dir)
                return result
            finally:
                with lock:
                    remote.discard(handle)
            nonlocal built
            built += run.images_built
            if run.usage is None:
                return run.result
            result = with_relay_usage(run.result, run.usage)
            result.write(run.trial_dir, redacting=secrets.scrub if secrets is not None else ())
            return result

        if stopping.is_set():
            return None
        return asyncio.run_coroutine_threadsafe(go(), loop).result()

    def run_one(task: Task, attempt: int) -> TrialResult | None:
        """One trial, and again (a new trial, the failed one's directory removed, as
        Harbor's ``--max-retries``) while it ended with an exception Harbor retries."""
        for retry in range(max_retries + 1):
            result = run_once(task, attempt)
            if result is None:
                return None
            info = result.exception_info
            if (
                retry == max_retries
                or info is None
                or not policy_for(info.exception_type).should_retry
                or stopping.is_set()
            ):
                break
            emit(JobEvent("retry", task, attempt, result=result))
            shutil.rmtree(job_dir / result.trial_name, ignore_errors=True)
            if stopping.wait(min(RETRY_MAX_WAIT_SEC, RETRY_MIN_WAIT_SEC * 2**retry)):
                return None
        assert result is not None
        with lock:
            results.append(result)
        emit(JobEvent("finished", task, attempt, result=result))
        return result

    def spec_of(task: Task) -> TrialSpec:
        return make_spec(task, job_dir) if make_spec else TrialSpec(task, job_dir)

    def run_once(task: Task, attempt: int) -> TrialResult | None:
        nonlocal built
        if stopping.is_set():
            return None
        spec = replace(spec_of(task), source=dataset_name)
        if slots is None:
            return run_remote(task, attempt, spec, None)
        limits = ContainerLimits.resolve(spec.policy, task.config.environment)
        turn = slots.admit(limits.memory_mb, may_go_ahead=not task.config.environment.gpus)
        if turn is None:
            return None
        try:
            if executor is not None:
                return run_remote(task, attempt, spec, turn)
            return run_here(task, attempt, spec, turn)
        finally:
            turn.done()

    def run_here(task: Task, attempt: int, spec: TrialSpec, turn: Turn) -> TrialResult:
        nonlocal built
        assert runtime is not None

        def on_phase(phase: TrialPhase) -> None:
            if phase is TrialPhase.TEARDOWN:
                # Its reward is read: the removal is clean-up, the slot the next trial's.
                turn.done()
            emit(JobEvent("phase", task, attempt, phase=phase))

        trial = create_trial(
            runtime,
            trial_request(spec, package_cache=package_cache, wait_turn=turn.wait),
            on_phase=on_phase,
        )
        trial.dir.mkdir(parents=True, exist_ok=True)
        (trial.dir / "config.json").write_text(
            json.dumps(harbor_trial_config(task, trial.dir, job_id, agent), indent=2)
        )
        with lock:
            active.add(trial)
        try:
            if stopping.is_set():
                trial.cancel()
            result = trial.run()
        finally:
            with lock:
                active.discard(trial)
        with lock:
            built += trial.images_built
        return result

    interrupted = False
    cause: KeyboardInterrupt | None = None
    # Trials run here: the next ones start ahead of their slot (harbor_exec.jobs.ahead),
    # within the first trial's policy (every trial of a job has the same). None: trials
    # run elsewhere (a Ray cluster), n_concurrent at once.
    slots: RunSlots | None = None
    if (executor is None or executor.trials_run_here) and plan:
        slots = RunSlots.for_policy(n_concurrent, spec_of(plan[0][0]).policy)
    workers = slots.workers if slots is not None else n_concurrent
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="hx-trial")
    futures: list[Future[TrialResult | None]] = [pool.submit(run_one, t, a) for t, a in plan]
    try:
        pending = set(futures)
        while pending:
            _done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
    except KeyboardInterrupt as exc:
        interrupted = True
        cause = exc
        stopping.set()
        if slots is not None:
            slots.stop()
        with lock:
            running = list(active)
        for trial in running:
            trial.cancel()
        if executor is not None and loop is not None:
            with lock:
                handles = list(remote)
            for handle in handles:
                loop.call_soon_threadsafe(executor.cancel, handle)
        pool.shutdown(wait=True, cancel_futures=True)
    else:
        pool.shutdown(wait=True)
    finally:
        if executor is not None and loop is not None:
            asyncio.run_coroutine_threadsafe(executor.aclose(), loop).result(timeout=120)
            loop.call_soon_threadsafe(loop.stop)

    job_result = JobResult(
        id=job_id,
        started_at=started,
        updated_at=datetime.now(),
        finished_at=datetime.now(),
        n_total_trials=n_attempts * len(tasks),
        stats=job_stats(results, dataset=dataset_name, **_evals_agent(results, agent)),
        invalid_tasks={str(e.task): str(e) for e in invalid_tasks},
    )
    job_result.stats.n_pending_trials = n_attempts * len(tasks) - len(results)
    (job_dir / "result.json").write_text(job_result.model_dump_json(indent=2), encoding="utf-8")
    outcome = JobOutcome(
        job_dir=job_dir,
        results=sorted(results, key=lambda r: (r.task_name, r.trial_name)),
        invalid_tasks=list(invalid_tasks),
        images_built=built,
        job_result=job_result,
        interrupted=interrupted,
        tasks=list(tasks),
        reused=len(kept),
    )
    if interrupted:
        raise JobInterrupted(outcome, cause)
    return outcome


def _evals_agent(results: Sequence[TrialResult], agent: Mapping[str, Any]) -> dict[str, Any]:
    """The agent and model the job's stats are keyed by, as Harbor keys them (the
    trials' ``agent_info``; before any trial ended, the job's agent config)."""
    if results:
        info = results[0].agent_info
        return {"agent": info.name, "model": info.model_info.name if info.model_info else None}
    model = agent.get("model_name")
    return {
        "agent": str(agent.get("name") or "oracle"),
        "model": str(model).partition("/")[2] or str(model) if model else None,
    }


def with_relay_usage(result: TrialResult, usage: ModelUsage) -> TrialResult:
    """``result`` with the relay's counts as its ``agent_result`` (what Harbor's
    viewer and the job's totals read): the agent's own counts move to
    ``agent_result.metadata["agent_usage"]``, and ``["usage_mismatch"]`` says where
    they differ from the relay's (flagged, never failed: an agent in a container can
    rewrite its own)."""
    own = result.agent_result or AgentResult()
    agent_usage = {
        "input_tokens": own.n_input_tokens,
        "cached_tokens": own.n_cache_tokens,
        "output_tokens": own.n_output_tokens,
        "cost_usd": own.cost_usd,
    }
    metadata = {**(own.metadata or {}), "usage_source": "relay", "agent_usage": agent_usage}
    mismatch = usage.disagreement(agent_usage)
    if mismatch is not None:
        metadata["usage_mismatch"] = mismatch
    relayed = own.model_copy(
        update={
            "n_input_tokens": usage.prompt_tokens,
            "n_cache_tokens": usage.cached_tokens,
            "n_output_tokens": usage.completion_tokens,
            "cost_usd": usage.cost_usd,
            "metadata": metadata,
        }
    )
    return result.model_copy(update={"agent_result": relayed})


class JobInterrupted(KeyboardInterrupt):
    """Ctrl-C during a job: every trial was cancelled; ``outcome`` holds what finished."""

    def __init__(self, outcome: JobOutcome, cause: KeyboardInterrupt | None = None) -> None:
        super().__init__("interrupted")
        self.outcome = outcome
        self.cause = cause  # the KeyboardInterrupt (or signal) that stopped the job


def summary_rows(outcome: JobOutcome) -> list[dict[str, Any]]:
    """One row per trial (and per task that failed to load), for the final table."""
    rows: list[dict[str, Any]] = []
    for result in outcome.results:
        seconds = None
        if result.started_at and result.finished_at:
            seconds = (result.finished_at - result.started_at).total_seconds()
        rewards = result.verifier_result.rewards if result.verifier_result else None
        rows.append(
            {
                "task": result.task_name,
                "trial": result.trial_name,
                "rewards": rewards,
                "seconds": seconds,
                "passed": is_full_reward(result),
                "reason": failure_reason(result),
                "unusable": no_scalar_reward(result),
            }
        )
    for error in outcome.invalid_tasks:
        rows.append(
            {
                "task": error.task,
                "trial": None,
                "rewards": None,
                "seconds": None,
                "passed": False,
                "reason": f"{type(error).__name__}: {error}",
                "unusable": None,
            }
        )
    return rows
