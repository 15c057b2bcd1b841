"""The agent interface: what a trial asks of an agent, and what an agent kind says it needs.

Two halves, as in Harbor (``BaseAgent`` beside its ``AgentConfig``):

* ``AgentSpec``: one agent kind as plain, picklable data inside a ``TrialSpec``. It
  says what it mounts (``relay``: how it reaches the rollout's model relay; ``layer``:
  a prebuilt read-only layer the trial installs and mounts, its materialization) and
  makes the runnable agent of one trial on this machine (``agent``). Executors and
  specs ask only this interface: no branch on the kind.
* ``Agent``: the runnable agent a trial drives against its started container, seen
  through ``AgentSession`` (the trial's ``TrialSession`` implements it).

A new agent kind is one module (or folder) of ``harbor_exec.agents`` with its spec and
its agent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from harbor_exec.agents.native.layer import AgentLayer
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.sandbox.runtime import ContainerRuntime, ExecResult
from harbor_exec.sandbox.users import ROOT_ID
from harbor_exec.tasks.task import Task

#: How Harbor runs the task's own scripts: the image's bash.
TASK_SHELL = ("bash", "-c")


class ModelInfo(BaseModel):
    name: str
    provider: str | None = None


class AgentInfo(BaseModel):
    """Harbor's ``agent_info`` in ``result.json``."""

    name: str
    version: str
    model_info: ModelInfo | None = None


class AgentSession(Protocol):
    """A started trial container, as agents see it (``harbor_exec.trial.session.TrialSession``).

    ``pending_files`` is a tar of files the trial placed before the agent, still to
    go in with the first command; ``agent_user`` a numeric ``uid:gid``.
    """

    runtime: ContainerRuntime
    container_id: str
    task: Task
    pending_files: bytes | None
    agent_user: str

    @property
    def workdir(self) -> str | None: ...

    def bash(
        self,
        command: str,
        *,
        user: str = ROOT_ID,
        env: Mapping[str, str] | None = None,
        timeout_sec: float | None = None,
        stdin: bytes | None = None,
        shell: Sequence[str] = TASK_SHELL,
    ) -> ExecResult: ...


@dataclass(frozen=True)
class AgentRun:
    """How the agent phase ended."""

    exit_code: int | None
    timed_out: bool
    # A bundled workflow's ``sample.json``, taken from the runner's stdout as its exec
    # ended (b"": none came); None for agents that hand over no sample (the oracle).
    sample: bytes | None = None
    #: Files the agent wrote on the host (a native agent's ``agent/trajectory.json``),
    #: by path under the trial dir: kept over whatever the container's ``/logs`` says.
    host_files: Mapping[str, bytes] = field(default_factory=dict)
    #: Harbor's ``agent_result`` fields as the agent counted them (native agents).
    agent_result: Mapping[str, Any] | None = None
    #: What the agent raised (a native agent's model that cannot be reached): Harbor
    #: records it as the trial's exception and still verifies, as its policy says.
    error: BaseException | None = None


class Agent(Protocol):
    """Something that acts on the task inside the container."""

    @property
    def info(self) -> AgentInfo: ...

    def files(self, task: Task) -> list[ArchiveEntry]:
        """Files to place before the container starts."""
        ...

    def run(self, session: AgentSession, timeout_sec: float | None) -> AgentRun: ...


@dataclass(frozen=True)
class RelayUse:
    """How an agent reaches the rollout's model relay, when its trial has a model endpoint
    (the executor opens the relay on the trial's machine)."""

    #: The relay's directory mounted read-only into the agent's container (``RELAY_DIR``).
    mount: bool = True
    #: The agent is given the relay's socket path on this machine (it dials it from here).
    socket_path: bool = False
    #: The relay keeps the rollout's last chat call: the agent's sample is read from it.
    record_chat: bool = False


@dataclass(frozen=True)
class AgentInputs:
    """What one trial gives its agent on this machine: from its secrets (the relay token,
    the workflow's ``rollout.json``), its content (the bundle's agent part) and the
    relay the executor opened (its socket, its record of the last chat call)."""

    #: None: the trial has no model endpoint (``TrialSecrets.model``).
    model_token: str | None = field(default=None, repr=False)
    #: The chat URL's path (``/v1``), as the agent's ``api_base`` on the relay.
    relay_path: str = "/v1"
    relay_socket: str | None = None
    relay_chat: Callable[[], Mapping[str, Any] | None] | None = field(default=None, repr=False)
    #: ``TrialSecrets.agent_input``: a workflow's ``rollout.json``.
    rollout_input: bytes | None = field(default=None, repr=False)
    #: ``TrialContent.bundle_files``: the bundle's agent part.
    bundle_files: Sequence[ArchiveEntry] = field(default=(), repr=False)


class AgentSpec(Protocol):
    """One agent kind in a ``TrialSpec`` (plain, picklable data; see module doc)."""

    @property
    def info(self) -> AgentInfo: ...

    @property
    def relay(self) -> RelayUse:
        """How the agent reaches the rollout's model relay."""
        ...

    @property
    def layer(self) -> AgentLayer | None:
        """The prebuilt layer the trial installs (when missing) and mounts read-only at
        ``AGENT_MOUNT``; prepared before the trial (prewarm, the backend's start)."""
        ...

    def agent(self, inputs: AgentInputs) -> Agent:
        """The runnable agent of one trial; ``ValueError`` when ``inputs`` lack what it
        needs."""
        ...


__all__ = [
    "TASK_SHELL",
    "Agent",
    "AgentInfo",
    "AgentInputs",
    "AgentRun",
    "AgentSession",
    "AgentSpec",
    "ModelInfo",
    "RelayUse",
]
