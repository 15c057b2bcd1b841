"""A bundled ``AgentWorkflow`` as the agent: the runner on the read-only runtime's Python."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from harbor_exec.agents.base import (
    Agent,
    AgentInfo,
    AgentInputs,
    AgentRun,
    AgentSession,
    RelayUse,
)
from harbor_exec.agents.native.layer import AgentLayer
from harbor_exec.container.exchange import (
    AGENT_INPUT,
    MANIFEST_PATH,
    RUNNER_OUTPUT,
    RUNTIME_PYTHON,
    USER_CODE_DIR,
    RolloutInput,
    in_logs,
    unframe_sample,
)
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.sandbox.runtime_volume import RUNTIME_SHELL
from harbor_exec.tasks.task import Task


@dataclass(frozen=True, kw_only=True)
class WorkflowAgent:
    """A bundled ``AgentWorkflow``, run by ``python -m harbor_exec.container.runner agent``
    on the read-only runtime's Python (any image: no Python, musl, a non-root user).

    ``bundle_files`` are the bundle's agent part: its manifest without grader refs and
    the user's code (the unpacked wheel) without the grader's and its config's modules;
    ``rollout_input`` is ``/logs/agent/rollout.json`` (prompt, metadata, chat URL and
    key; never the label). The runner hands the sample back on its stdout; the trial
    keeps that copy as ``agent/sample.json``, whatever the container's file says later.
    """

    name: str
    version: str
    bundle_files: Sequence[ArchiveEntry] = field(repr=False)
    rollout_input: bytes = field(repr=False)

    @property
    def info(self) -> AgentInfo:
        return AgentInfo(name=self.name, version=self.version)

    def files(self, task: Task) -> list[ArchiveEntry]:
        return [*self.bundle_files, ArchiveEntry(in_logs(AGENT_INPUT), self.rollout_input, 0o644)]

    def for_step(self, task: Task) -> WorkflowAgent:
        """The workflow of one step: a fresh run whose prompt is the step's instruction
        (as Harbor runs each step's agent with that step's instruction)."""
        step_input = RolloutInput.model_validate_json(self.rollout_input)
        step_input.prompt = [{"role": "user", "content": task.instruction}]
        return replace(self, rollout_input=step_input.model_dump_json().encode())

    def run(self, session: AgentSession, timeout_sec: float | None) -> AgentRun:
        # The sample comes back on the exec's stdout (see ``exchange.frame_sample``),
        # taken when the runner's exec ends: a ``sample.json`` rewritten later by
        # something the workflow left running changes nothing.
        result = session.bash(
            f"exec {RUNTIME_PYTHON} -I -m harbor_exec.container.runner agent "
            f"--sample-to-stdout --manifest {MANIFEST_PATH} --code-dir {USER_CODE_DIR} "
            f"2> {in_logs(RUNNER_OUTPUT)}",
            user=session.agent_user,
            timeout_sec=timeout_sec,
            shell=RUNTIME_SHELL,
        )
        sample = unframe_sample(result.output) or b""
        return AgentRun(exit_code=result.exit_code, timed_out=result.timed_out, sample=sample)


@dataclass(frozen=True)
class WorkflowAgentSpec:
    """A bundled ``AgentWorkflow``: its files are the spec's ``bundle`` (the agent's
    part: no grader, no grader config), its ``rollout.json`` is
    ``TrialSecrets.agent_input``."""

    name: str
    version: str

    @property
    def info(self) -> AgentInfo:
        return AgentInfo(name=self.name, version=self.version)

    @property
    def relay(self) -> RelayUse:
        return RelayUse()

    @property
    def layer(self) -> AgentLayer | None:
        return None

    def agent(self, inputs: AgentInputs) -> Agent:
        if inputs.rollout_input is None:
            raise ValueError("a workflow trial needs its rollout input (TrialSecrets.agent_input)")
        return WorkflowAgent(
            name=self.name,
            version=self.version,
            bundle_files=inputs.bundle_files,
            rollout_input=inputs.rollout_input,
        )


__all__ = ["WorkflowAgent", "WorkflowAgentSpec"]
