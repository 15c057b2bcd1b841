"""What a trial is, as plain data: ``TrialSpec`` (picklable, no secret).

The task (its snapshot travels by ``task_key``), the agent kind and the verifier kind,
the workflow bundle and its dependency layer by content key, the sandbox policy. The
executors build it (``harbor_exec.executors.spec``: with the secrets and this machine's
copies, ``trial_request`` makes the runnable ``TrialRequest``, which holds it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from harbor_exec.agents.base import AgentSpec
from harbor_exec.agents.oracle import OracleAgentSpec
from harbor_exec.sandbox.deps import DepsLayer
from harbor_exec.tasks.task import Task
from harbor_exec.trial.policy import SandboxPolicy

#: "tests": the task's own ``tests/`` (with ``TrialSecrets.verifier_input`` as
#: ``/tests/rollout.json`` when given); "grader": the bundle's grader through a
#: generated ``test.sh`` (for tasks without tests), from the spec's ``grader_bundle``.
VerifierKind = Literal["tests", "grader"]


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


def content_digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def task_key(task: Task) -> str:
    """A task snapshot's content key (its directory is named by its hash)."""
    return "t-" + content_digest(task.root.name, *task.digests, task.name)


def deps_key(deps: DepsLayer) -> str:
    """A dependency layer's wheelhouse content key (by requirement set)."""
    return "d-" + content_digest(deps.requirements_digest, str(deps.wheelhouse))


__all__ = ["TrialSpec", "VerifierKind", "content_digest", "deps_key", "task_key"]
