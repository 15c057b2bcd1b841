"""Multi-step tasks (``[[steps]]``): ``MultiStepTrial``, as Harbor 0.26 runs them.

One container for the whole trial; each step, in order:

1. prepare: ``/logs/agent`` emptied (mode 777); after a step whose verifier ran in
   the container, ``/logs/verifier`` and ``/tests`` emptied too (nothing of the
   grading harness is left for the next agent); the step's agent files placed (the
   oracle's ``/solution`` from ``steps/<name>/solution/``, else ``solution/``; a
   workflow's ``rollout.json`` with the step's instruction as its prompt);
   ``steps/<name>/workdir/`` copied into the container's working directory and its
   ``setup.sh`` run there (``bash <workdir>/setup.sh`` as the step's agent user; a
   non-zero exit is the step's ``RuntimeError``); the step's ``healthcheck``.
2. agent: the trial's own agent phase (``Trial.run_agent``) under the step's
   ``[steps.agent].timeout_sec`` (else the task's) and user.
3. verifier: the trial's own verifier in the step's mode (Harbor's
   ``resolve_step_verifier_mode``): shared (``Trial.verify_shared``), or separate
   (``Trial.verify_separate``: a fresh container with the step's artifacts; the
   agent's container stays for the next step, and is removed before the last
   step's verifier, as Harbor stops it). ``tests/`` and then ``steps/<name>/tests/``
   are placed at ``/tests``, under the step's ``[steps.verifier]`` timeout (Harbor
   reads the step's, whose default is 600 s), user and env (over the task's). The
   reward is read back and stored on the host, with the step's result, before
   anything of the next step runs.
4. archive: ``agent/``, ``verifier/`` and ``artifacts/`` (with its
   ``manifest.json``) move to ``steps/<name>/``; the step's result is a
   ``StepResult`` in ``result.json``'s ``step_results``.

A step that recorded an exception and has no verifier result stops the trial, as
does a ``min_reward`` gate that fails (a float gates the ``reward`` key, a mapping
each key it names; a missing result or key counts as minus infinity; gates are
ignored when verification is off). The trial's reward is then
``multi_step_reward_strategy``'s: ``mean`` (the default: per key, over the steps
that have a verifier result, a key a step lacks counting 0) or ``final`` (the last
step run's result, as it is).

A step that cannot be prepared (``setup.sh``, healthcheck, workdir) after an earlier
step's agent ran is the agent's doing, not the task's: the step keeps Harbor's
exception, the trial records ``StepPreparationError``, and that step and every step
it stops count 0 in the mean (``final``: the trial's reward is 0), so an agent
cannot drop the step it would fail by breaking the container first.

A bundled workflow runs once per step, each time fresh with that step's
instruction; the rollout's sample (``agent/sample.json``) is the steps' samples
joined: their messages in step order, ``metrics`` and ``extra_fields`` merged (a
later step's key wins), and the first step's error form if any step failed to
hand over a sample. Each step's own sample stays in ``steps/<name>/agent/``.

Refused by name (Harbor 0.26 runs them): a step's own verifier environment
(``[steps.verifier.environment]``, ``steps/<name>/tests/Dockerfile``; a separate
verifier runs in the task's), and agents that cannot take a per-step instruction
(Harbor's native agents here).
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from harbor_exec.agents.base import Agent
from harbor_exec.errors import StepPreparationError, TaskConfigError, TrialError
from harbor_exec.sandbox.archives import ArchiveEntry, build_archive, tree_entries
from harbor_exec.sandbox.users import UnknownUserError
from harbor_exec.tasks.config import StepConfig
from harbor_exec.tasks.task import Task, TaskStep
from harbor_exec.trial.results import (
    StepResult,
    TimingInfo,
    TrialResult,
    VerifierResult,
    utcnow,
)
from harbor_exec.trial.session import TrialSession
from harbor_exec.trial.trial import Trial
from harbor_exec.trial.verifiers import TestsVerifier

#: The trial-dir parts each step's outputs move out of, into ``steps/<name>/``.
_STEP_PARTS = ("agent", "verifier", "artifacts")


def step_verifier_mode(task: Task, step: StepConfig) -> str:
    """Harbor's ``resolve_step_verifier_mode``: the step's explicit mode, else separate
    when the step sets ``[steps.verifier.environment]``, else the task's mode."""
    for config in (step.verifier, task.config.verifier):
        if config.environment_mode is not None:
            return config.environment_mode
        if config.environment is not None:
            return "separate"
    return "shared"


def step_verifier(verifier: TestsVerifier, task: Task) -> TestsVerifier:
    """``verifier`` for ``task``'s step (the task itself: unchanged): the step's
    ``tests/`` placed over the task's, when the verifier runs the task's tests."""
    if task.step is None or verifier.bundled_grader or verifier.tests_dir != task.tests_dir:
        return verifier
    return replace(verifier, step_tests_dir=task.step_tests_dir)


def min_reward_failure(
    rewards: dict[str, float | int] | None, min_reward: float | dict[str, float]
) -> str | None:
    """Harbor's ``_min_reward_failure``: why the gate fails, or None when it passes."""
    thresholds = {"reward": min_reward} if isinstance(min_reward, int | float) else min_reward
    for key, threshold in thresholds.items():
        actual = rewards.get(key, -math.inf) if rewards else -math.inf
        if actual < threshold:
            return f"{key}={actual} below min_reward {threshold}"
    return None


def should_stop(step: StepConfig, result: StepResult, *, verify: bool) -> bool:
    """Harbor's ``_should_stop_after_step``."""
    if result.exception_info is not None and result.verifier_result is None:
        return True
    if step.min_reward is None or not verify:
        return False
    rewards = result.verifier_result.rewards if result.verifier_result else None
    return min_reward_failure(rewards, step.min_reward) is not None


def select_reward(
    strategy: str | None, steps: list[StepResult], *, forfeited: int = 0
) -> VerifierResult | None:
    """The trial's reward from its steps' (Harbor's ``_select_multi_step_reward``), with
    ``forfeited`` steps (one the agent left unpreparable and those it stopped) at 0."""
    if not steps:
        return None
    valid = [s.verifier_result.rewards or {} for s in steps if s.verifier_result is not None]
    keys = {key for rewards in valid for key in rewards} or ({"reward"} if forfeited else set())
    if forfeited and strategy == "final":
        return VerifierResult(rewards=dict.fromkeys(sorted(keys), 0.0))
    if strategy == "final":
        return steps[-1].verifier_result
    if not keys:
        return None
    count = len(valid) + forfeited
    return VerifierResult(
        rewards={key: sum(r.get(key, 0) for r in valid) / count for key in sorted(keys)}
    )


def join_samples(samples: list[bytes]) -> bytes:
    """The rollout's sample from each step's (see the module doc)."""
    messages: list[Any] | None = None
    metrics: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for data in samples:
        if not data:
            return data
        try:
            parsed = json.loads(data)
        except ValueError:
            return data  # not a sample: the outcome reports it as the step's was
        if not isinstance(parsed, dict) or "error" in parsed:
            return data
        if isinstance(parsed.get("messages"), list):
            messages = [*(messages or []), *parsed["messages"]]
        for target, key in ((metrics, "metrics"), (extra, "extra_fields")):
            value = parsed.get(key)
            if isinstance(value, dict):
                target.update(value)
    return json.dumps({"messages": messages, "metrics": metrics, "extra_fields": extra}).encode()


class MultiStepTrial(Trial):
    """A trial of a multi-step task (Harbor 0.26's ``MultiStepTrial``): the trial's own
    environment, agent, verifier and teardown, run once per step (see the module doc)."""

    runs_steps = True

    def check_supported(self) -> None:
        """Refuse, before anything is built, what harbor-exec does not run for steps."""
        task, request = self.request.spec.task, self.request
        for index, step in enumerate(task.steps, start=1):
            where = f"[[steps]] #{index} ({step.name!r})"
            own = task.step_dir(step.name) / "tests"
            if step.config.verifier.environment is not None or any(
                (own / name).is_file() for name in ("Dockerfile", "docker-compose.yaml")
            ):
                raise TaskConfigError(
                    task.name,
                    f"{where}: a step's own verifier environment ([steps.verifier.environment] "
                    f"or steps/{step.name}/tests/Dockerfile) is not supported here; a separate "
                    "verifier runs in the task's ([verifier.environment], tests/Dockerfile or "
                    "environment/)",
                    file="task.toml",
                )
            for phase, config in (
                ("agent", step.config.agent),
                ("verifier", step.config.verifier),
            ):
                if config.network_mode is not None or config.allowed_hosts is not None:
                    # The container's network is made once for every step; a step's own
                    # phase policy would need it changed mid-trial.
                    raise TaskConfigError(
                        task.name,
                        f"{where}: [steps.{phase}].network_mode/allowed_hosts is not supported "
                        f"here; set the policy on the task's [{phase}] or [environment]",
                        file="task.toml",
                    )
        if not callable(getattr(request.agent, "for_step", None)):
            raise TaskConfigError(
                task.name,
                f"multi-step tasks ([[steps]]) cannot run with the agent "
                f"{request.agent.info.name!r} here (the oracle and bundled workflows can)",
                file="task.toml",
            )

    def verifier_for(self, task: Task) -> TestsVerifier:
        """The step's ``tests/`` placed over the task's (see ``step_verifier``)."""
        return step_verifier(super().verifier_for(task), task)

    def run_phases(self, session: TrialSession, result: TrialResult) -> None:
        """Every step of the task in order, into ``result.step_results``, then the
        trial's reward by the task's strategy."""
        if self.exception is not None:
            return
        request = self.request
        spec, agent = request.spec, request.agent
        task = spec.task
        now = utcnow()
        result.agent_setup = TimingInfo(started_at=now, finished_at=now)
        result.step_results = []
        samples: list[bytes] = []
        if session.pending_files is not None:  # before any step places its own files
            self.runtime.put_archive(session.container_id, session.pending_files)
            session.pending_files = None
        tests_used = False
        forfeited = 0
        try:
            for index, step in enumerate(task.steps):
                step_result = StepResult(step_name=step.name)
                result.step_results.append(step_result)
                view = task.for_step(step)
                # The trial reads the step's view of the task and its agent for the step.
                request.spec = replace(spec, task=view)
                request.agent = _agent_for_step(agent, view)
                session.task = view
                try:
                    last = step is task.steps[-1]
                    prepared = self._run_step(
                        session, step, step_result, reset_tests=tests_used, last=last
                    )
                    if not prepared and index > 0:
                        forfeited = len(task.steps) - index
                finally:
                    exception = self.take_exception()
                    if step_result.exception_info is None and exception is not None:
                        step_result.exception_info = exception
                    if self.agent_sample is not None:
                        samples.append(self.agent_sample)
                    self._archive_step(step)
                tests_used = step_result.verifier is not None and not self._separate(step)
                if should_stop(step.config, step_result, verify=request.spec.verify):
                    break
        finally:
            request.spec, request.agent = spec, agent
            session.task = task
        strategy = task.config.multi_step_reward_strategy
        result.verifier_result = select_reward(strategy, result.step_results, forfeited=forfeited)
        if forfeited:
            # An earlier step's agent had the container: its doing, not the task's. The
            # step keeps Harbor's exception; the trial records the agent's.
            failed = result.step_results[-1]
            cause = failed.exception_info.exception_message if failed.exception_info else ""
            self.record(
                StepPreparationError(
                    f"step {failed.step_name!r} could not be prepared after an earlier "
                    f"step's agent ran: {cause}"
                )
            )
        if samples:
            self.replace_agent_sample(join_samples(samples))
        for part in _STEP_PARTS:
            _remove_empty_tree(self.dir / part)

    def _separate(self, step: TaskStep) -> bool:
        """Whether ``step`` verifies in a fresh container (the operator's policy, the
        bundled grader's mode, else the step's or the task's ``environment_mode``)."""
        request = self.request
        if request.spec.policy.verifier_mode == "separate":
            return True
        if request.verifier is not None and request.verifier.bundled_grader:
            return request.spec.policy.grader_verifier_mode == "separate"
        return step_verifier_mode(request.spec.task, step.config) == "separate"

    def _run_step(
        self,
        session: TrialSession,
        step: TaskStep,
        step_result: StepResult,
        *,
        reset_tests: bool,
        last: bool,
    ) -> bool:
        """Run ``step``; False when it could not be prepared (recorded on it)."""
        self.begin_outputs()
        for part in ("agent", "verifier"):
            (self.dir / "steps" / step.name / part).mkdir(parents=True, exist_ok=True)
        try:
            self._prepare_step(session, step, reset_tests=reset_tests)
        except (TrialError, RuntimeError) as exc:  # the step's: recorded on it, then it stops
            self.check_cancelled()
            self.record(exc)  # Harbor's exception, on the step
            return False
        scratch = TrialResult.model_construct()
        self.run_agent(session, scratch)
        step_result.agent_result, step_result.agent_execution = (
            scratch.agent_result,
            scratch.agent_execution,
        )
        if self.should_verify():
            if self._separate(step):
                # The agent's container stays for the next step; after the last, Harbor
                # stops it before the verifier runs.
                self.verify_separate(session, scratch, keep_agent=not last)
            else:
                self.verify_shared(session, scratch)
            step_result.verifier = scratch.verifier
            step_result.verifier_result = scratch.verifier_result
        else:
            self.download_logs(session.container_id)
            self.artifacts.collect(session.container_id, self.request.spec.task)
            self.record_agent_overflow()
        return True

    def _prepare_step(self, session: TrialSession, step: TaskStep, *, reset_tests: bool) -> None:
        """Harbor's ``_prepare_step``: reset the log dirs, place the step's files, copy its
        workdir, run its ``setup.sh`` and its healthcheck."""
        view, runtime = self.request.spec.task, self.runtime
        self._resolve_step_users(session, view)
        entries = [ArchiveEntry("/logs/agent", None, 0o777, fresh=True)]
        if reset_tests:
            entries += [
                ArchiveEntry("/logs/verifier", None, 0o777, fresh=True),
                ArchiveEntry("/tests", None, 0o755, fresh=True),
            ]
        entries += self.request.agent.files(view)
        workdir_files = view.step_workdir
        if workdir_files is not None and workdir_files.is_dir():
            # The directory each exec starts in, as the step's agent user sees it.
            ran = session.bash("pwd", user=session.agent_user, timeout_sec=60)
            workdir = ran.output.decode(errors="replace").strip() or "/"
            if not workdir.startswith("/"):
                workdir = "/"
            # (the first entry is the directory itself, there already; "/" stays "")
            entries += tree_entries(workdir_files, workdir.rstrip("/"))[1:]
        else:
            workdir = ""
        runtime.put_archive(session.container_id, build_archive(entries))
        self.check_cancelled()
        if workdir and (workdir_files is not None and (workdir_files / "setup.sh").is_file()):
            script = f"{workdir.rstrip('/')}/setup.sh"
            ran = session.bash(f"bash {shlex.quote(script)}", user=session.agent_user)
            self.check_cancelled()
            if ran.exit_code != 0 or ran.timed_out:
                stderr = ran.errors.decode(errors="replace")[-2000:]
                # Harbor's exception for it, recorded on the step.
                raise RuntimeError(
                    f"Step '{step.name}' setup.sh exited with code {ran.exit_code}: {stderr}"
                )
        self.run_healthcheck(session, step.config.healthcheck)

    def _resolve_step_users(self, session: TrialSession, view: Task) -> None:
        """The step's agent and verifier users (the step's, else the task's, else the
        image's USER), resolved against the account files read before anything ran."""
        accounts = self.accounts
        if accounts is None:
            return
        for role, wanted in (("agent", view.agent_user), ("verifier", view.verifier_user)):
            user = self.default_user if wanted is None or str(wanted) == "" else wanted
            try:
                resolved = accounts.resolve(user)
            except UnknownUserError as exc:
                raise TaskConfigError(
                    view.name, f"[steps.{role}].user = {user!r}: {exc}", file="task.toml"
                ) from None
            setattr(session, f"{role}_user", resolved)

    def _archive_step(self, step: TaskStep) -> None:
        """Move what the step wrote under the trial dir into ``steps/<name>/``."""
        self.artifacts.write_manifest(self.request.spec.task)
        target = self.dir / "steps" / step.name
        for part in _STEP_PARTS:
            source = self.dir / part
            if not source.exists():
                continue
            destination = target / part
            destination.mkdir(parents=True, exist_ok=True)
            for child in list(source.iterdir()):
                moved = destination / child.name
                if moved.exists() or moved.is_symlink():
                    if moved.is_dir() and not moved.is_symlink():
                        shutil.rmtree(moved)
                    else:
                        moved.unlink()
                shutil.move(str(child), moved)
        # Nothing of this step is read again at teardown (its reward is on the host).
        self.outputs_archived()


def _agent_for_step(agent: Agent, view: Task) -> Agent:
    for_step = getattr(agent, "for_step", None)
    assert callable(for_step)  # check_supported refused agents without it
    step_agent: Agent = for_step(view)
    return step_agent


def _remove_empty_tree(root: Path) -> None:
    if not root.is_dir() or root.is_symlink():
        return
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()
    if not any(root.iterdir()):
        root.rmdir()


__all__ = [
    "MultiStepTrial",
    "join_samples",
    "min_reward_failure",
    "select_reward",
    "should_stop",
    "step_verifier",
    "step_verifier_mode",
]
