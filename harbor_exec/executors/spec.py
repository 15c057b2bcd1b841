"""What a trial is, apart from where it runs (as uvicorn's ``Config`` is apart from its ``Server``).

* ``TrialSpec``: plain, picklable, no secret. The task (its snapshot travels by
  ``task_key``), the agent and the verifier as plain data, the workflow bundle and
  its dependency layer by content key, the sandbox policy.
* ``TrialSecrets``: everything per-rollout that may hold a secret (the model
  endpoint with the trainer's key, the values to scrub, the agent's and the
  verifier's ``rollout.json``). The Ray driver seals it for one node.
* ``TrialContent``: one machine's copies of what a spec names by key (the task
  snapshot, the wheelhouse, the bundle's two parts: the agent's files and the
  grader's, which only the verifier side gets).

``trial_request`` turns the three into the runnable ``TrialRequest``; the local
executor and the Ray node both build their trials through it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from harbor_exec.sandbox.agent_layer import AgentLayer
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.sandbox.deps import DepsLayer
from harbor_exec.sandbox.runtime import Mount
from harbor_exec.trial.agents import (
    Agent,
    OracleAgent,
    TestsVerifier,
    WorkflowAgent,
    grader_verifier,
    tests_verifier,
)
from harbor_exec.trial.native import NativeAgent, is_in_container_agent
from harbor_exec.trial.results import AgentInfo
from harbor_exec.trial.task import Task
from harbor_exec.trial.trial import SandboxPolicy, TrialRequest


@dataclass(frozen=True)
class OracleAgentSpec:
    """Harbor's ``oracle``: runs the task's ``solution/solve.sh``."""

    @property
    def info(self) -> AgentInfo:
        return OracleAgent.info


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


@dataclass(frozen=True)
class NativeAgentSpec:
    """One of Harbor's own agents (``harbor_exec.trial.native``), run unchanged: its
    name, model route and options (plain JSON values), its setup timeout and the
    instruction. The relay token it uses as its key is ``TrialSecrets.model.token``."""

    name: str
    model_name: str
    instruction: str = field(repr=False)
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    setup_timeout_sec: float | None = None
    #: An in-container agent's prebuilt layer (``harbor_exec.sandbox.agent_layer``).
    layer: AgentLayer | None = None

    @property
    def info(self) -> AgentInfo:
        return self.agent("", None).info

    @property
    def in_container(self) -> bool:
        """mini-swe-agent, opencode: run in the container, from their agent layer, via the
        relay mount."""
        return is_in_container_agent(self.name)

    def agent(
        self,
        token: str,
        relay_socket: str | None,
        relay_path: str = "/v1",
        relay_chat: Callable[[], Mapping[str, Any] | None] | None = None,
    ) -> NativeAgent:
        return NativeAgent(
            name=self.name,
            model_name=self.model_name,
            instruction=self.instruction,
            kwargs=self.kwargs,
            setup_timeout_sec=self.setup_timeout_sec,
            token=token,
            relay_socket=relay_socket,
            relay_path=relay_path,
            relay_chat=relay_chat,
        )


AgentSpec = OracleAgentSpec | WorkflowAgentSpec | NativeAgentSpec

#: "tests": the task's own ``tests/`` (with ``TrialSecrets.verifier_input`` as
#: ``/tests/rollout.json`` when given); "grader": the bundle's grader through a
#: generated ``test.sh`` (for tasks without tests), from the spec's ``grader_bundle``.
VerifierKind = Literal["tests", "grader"]


@dataclass(frozen=True)
class ModelEndpoint:
    """The trainer's chat endpoint for one rollout, and the token its workflow uses."""

    url: str
    api_key: str | None = field(repr=False)
    token: str = field(repr=False)
    # POST routes under the URL's path the relay forwards besides /chat/completions
    # (RelayLimits.extra_routes); here so they travel with the trial to its node.
    extra_routes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrialSecrets:
    """The part of a trial that may hold a secret; never logged, stored or shown."""

    model: ModelEndpoint | None = None  # the relay's upstream, for workflows
    scrub: Sequence[str] = field(default=(), repr=False)  # removed from the trial dir
    agent_input: bytes | None = field(default=None, repr=False)  # a workflow's rollout.json
    verifier_input: bytes | None = field(default=None, repr=False)  # the grader's, with the label


@dataclass(frozen=True)
class TrialSpec:
    """One trial as plain data (see module doc); ``trials_dir`` is where the
    submitter keeps trial directories, whichever machine runs the trial."""

    task: Task
    trials_dir: Path
    agent: AgentSpec = field(default_factory=OracleAgentSpec)
    verifier: VerifierKind = "tests"
    verify: bool = True
    trial_name: str | None = None
    source: str | None = None
    image: str | None = None  # run on this image instead of the task's own
    agent_timeout_sec: float | None = None  # override [agent].timeout_sec
    verifier_timeout_sec: float | None = None  # override [verifier].timeout_sec
    labels: Mapping[str, str] = field(default_factory=dict)
    rollout_id: str | None = None
    bundle: str | None = None  # content key of the bundle's agent part (the agent's files)
    # Content key of the bundle's grader part (manifest and code with the grader's
    # modules), set when the bundled grader verifies; never placed in the agent's container.
    grader_bundle: str | None = None
    deps: DepsLayer | None = None  # the bundle's dependency layer, built on the image
    policy: SandboxPolicy = field(default_factory=SandboxPolicy)

    @property
    def task_key(self) -> str:
        return task_key(self.task)

    @property
    def deps_key(self) -> str | None:
        return None if self.deps is None else deps_key(self.deps)


@dataclass(frozen=True)
class TrialContent:
    """This machine's copies of what a spec names by key, and where it writes trial
    directories (None: the spec's own paths; no bundle)."""

    task_root: Path | None = None
    wheelhouse: Path | None = None
    # ``spec.bundle``: the agent's part, placed in the agent's container.
    bundle_files: Sequence[ArchiveEntry] = field(default=(), repr=False)
    trials_dir: Path | None = None
    # ``spec.grader_bundle``: the grader's part, placed only under GRADER_DIR by the verifier.
    grader_files: Sequence[ArchiveEntry] = field(default=(), repr=False)


def content_digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def task_key(task: Task) -> str:
    """A task snapshot's content key (its directory is named by its hash)."""
    return "t-" + content_digest(task.root.name, *task.digests, task.name)


def deps_key(deps: DepsLayer) -> str:
    """A dependency layer's wheelhouse content key (by requirement set)."""
    return "d-" + content_digest(deps.requirements_digest, str(deps.wheelhouse))


def trial_request(
    spec: TrialSpec,
    secrets: TrialSecrets | None = None,
    content: TrialContent | None = None,
    *,
    mounts: Sequence[Mount] = (),
    relay_socket: str | None = None,
    relay_chat: Callable[[], Mapping[str, Any] | None] | None = None,
) -> TrialRequest:
    """The runnable trial of ``spec`` on this machine: its agent and verifier built
    from ``secrets`` and ``content``, with ``mounts`` in the agent's container (e.g.
    the model relay); ``relay_socket``: the host path of the rollout's relay socket,
    for a native agent that dials it from this process; ``relay_chat``: the relay's
    record of the last chat call, for an in-container native agent's sample."""
    secrets = secrets or TrialSecrets()
    content = content or TrialContent()
    task = spec.task
    if content.task_root is not None:
        task = replace(task, files=content.task_root)
    deps = spec.deps
    if deps is not None and content.wheelhouse is not None:
        deps = replace(deps, wheelhouse=content.wheelhouse)
    agent: Agent = OracleAgent()
    agent_layer: AgentLayer | None = None
    if isinstance(spec.agent, WorkflowAgentSpec):
        if secrets.agent_input is None:
            raise ValueError("a workflow trial needs its rollout input (TrialSecrets.agent_input)")
        agent = WorkflowAgent(
            name=spec.agent.name,
            version=spec.agent.version,
            bundle_files=content.bundle_files,
            rollout_input=secrets.agent_input,
        )
    elif isinstance(spec.agent, NativeAgentSpec):
        model = secrets.model
        if model is None:
            raise ValueError("a native agent's trial needs its model endpoint (TrialSecrets.model)")
        path = urlsplit(model.url).path.rstrip("/")
        agent = spec.agent.agent(model.token, relay_socket, path, relay_chat)
        if spec.agent.in_container:
            # Prepared at prewarm or the backend's start; None makes the agent's setup
            # fail, naming what is missing (nothing is fetched at trial time).
            agent_layer = spec.agent.layer
    verifier: TestsVerifier | None = None
    if spec.verifier == "grader":
        if secrets.verifier_input is None:
            raise ValueError("a bundled grader needs its input (TrialSecrets.verifier_input)")
        if not content.grader_files:
            raise ValueError("a bundled grader needs the bundle's grader part (grader_files)")
        verifier = grader_verifier(secrets.verifier_input, content.grader_files)
    elif secrets.verifier_input is not None:
        verifier = tests_verifier(task.tests_dir, secrets.verifier_input)
    return TrialRequest(
        task=task,
        trials_dir=content.trials_dir or spec.trials_dir,
        agent=agent,
        verifier=verifier,
        verify=spec.verify,
        trial_name=spec.trial_name,
        source=spec.source,
        image=spec.image,
        agent_timeout_sec=spec.agent_timeout_sec,
        verifier_timeout_sec=spec.verifier_timeout_sec,
        labels=spec.labels,
        rollout_id=spec.rollout_id,
        secrets=list(secrets.scrub),
        mounts=mounts,
        deps=deps,
        agent_layer=agent_layer,
        policy=spec.policy,
    )


__all__ = [
    "AgentSpec",
    "ModelEndpoint",
    "NativeAgentSpec",
    "OracleAgentSpec",
    "TrialContent",
    "TrialSecrets",
    "TrialSpec",
    "VerifierKind",
    "WorkflowAgentSpec",
    "content_digest",
    "deps_key",
    "task_key",
    "trial_request",
]
