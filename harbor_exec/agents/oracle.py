"""Harbor's ``oracle``: the task's ``solution/solve.sh`` as the agent."""

from __future__ import annotations

from dataclasses import dataclass

from harbor_exec.agents.base import (
    Agent,
    AgentInfo,
    AgentInputs,
    AgentRun,
    AgentSession,
    RelayUse,
)
from harbor_exec.agents.native.layer import AgentLayer
from harbor_exec.sandbox.archives import ArchiveEntry, tree_entries
from harbor_exec.tasks.config import resolve_env
from harbor_exec.tasks.task import Task


class OracleAgent:
    """Harbor's ``oracle``: runs the task's ``solution/solve.sh``."""

    info = AgentInfo(name="oracle", version="1.0.0")

    def files(self, task: Task) -> list[ArchiveEntry]:
        return tree_entries(task.solution_dir, "/solution", executable=["solve.sh"])

    def for_step(self, task: Task) -> OracleAgent:
        """The oracle of one step: its ``files`` and ``run`` read the step's view
        (``steps/<name>/solution/`` when the step has one, else ``solution/``)."""
        return self

    def run(self, session: AgentSession, timeout_sec: float | None) -> AgentRun:
        if not session.task.solve_script.is_file():
            # Harbor's oracle raises exactly this (recorded as FileNotFoundError),
            # instead of letting bash fail with exit 127. It names the task's own file,
            # not the snapshot we checked.
            task = session.task
            missing = task.path / task.solve_script.relative_to(task.root)
            if task.step is not None and task.solution_dir != task.root / "solution":
                raise FileNotFoundError(
                    "No OS-compatible solution script found for step "
                    f"'{task.step.name}': expected {missing}"
                )
            raise FileNotFoundError(f"Solution script not found: {missing}")
        config = session.task.config
        env = {
            "DEBIAN_FRONTEND": "noninteractive",
            **resolve_env(
                config.solution.env,
                task=session.task.name,
                field="[solution].env",
                allowed=session.task.env_allow,
            ),
        }
        result = session.bash(
            "(/solution/solve.sh) > /logs/agent/oracle.txt 2>&1",
            user=session.agent_user,
            env=env,
            timeout_sec=timeout_sec,
        )
        return AgentRun(exit_code=result.exit_code, timed_out=result.timed_out)


@dataclass(frozen=True)
class OracleAgentSpec:
    """Harbor's ``oracle``: runs the task's ``solution/solve.sh``."""

    @property
    def info(self) -> AgentInfo:
        return OracleAgent.info

    @property
    def relay(self) -> RelayUse:
        return RelayUse()

    @property
    def layer(self) -> AgentLayer | None:
        return None

    def agent(self, inputs: AgentInputs) -> Agent:
        return OracleAgent()


__all__ = ["OracleAgent", "OracleAgentSpec"]
