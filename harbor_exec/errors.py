"""Every named error of the trial engine, in one place.

Two families live here (standard library only: it ships in the container runtime too):

* user-input errors (``TaskError`` and friends): raised before anything runs,
  each message names the task, the file and the field at fault;
* trial errors: the exception names Harbor records in ``result.json``
  (``exception_info.exception_type``). Their class names are part of our
  result contract, so they match Harbor 0.26 exactly, and ``POLICIES`` carries
  Harbor's error policy for each (retry, grade, valid reward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class HarborExecError(Exception):
    """Base class of every error harbor-exec raises on purpose."""


# --------------------------------------------------------------------------- input


class TaskError(HarborExecError):
    """A task directory that cannot be used; the message says which file and why."""

    def __init__(self, task: str, message: str, *, file: str | None = None) -> None:
        self.task = task
        self.file = file
        where = f"{task}/{file}" if file else task
        super().__init__(f"task {where}: {message}")


class TaskConfigError(TaskError):
    """``task.toml`` does not parse or has an invalid field (named in the message)."""


class UnsafeTaskPathError(TaskError):
    """A task file is a symlink that leaves the task directory, or a path escapes it."""


class DatasetError(HarborExecError):
    """A path holds no valid Harbor task, or a task id does not name one."""


class DockerUnavailableError(HarborExecError):
    """The Docker engine does not answer; run ``scripts/setup.sh`` or start ``dockerd``."""


# --------------------------------------------------------------------------- trial


class TrialError(HarborExecError):
    """Base of the errors a trial records by class name in ``result.json``."""


class SandboxBuildFailedError(TrialError):
    """``docker build`` of the task's environment failed; the message ends with the log tail."""


class EnvironmentStartTimeoutError(TrialError):
    """Building or starting the environment took longer than ``build_timeout_sec``."""


class EnvironmentStartError(TrialError):
    """The container could not be created or started (bad workdir, engine error)."""


class AgentTimeoutError(TrialError):
    """The agent ran past ``[agent].timeout_sec``; it was killed and the trial still verified."""


class AgentSetupError(TrialError):
    """The agent could not be installed or prepared in the container."""


class VerifierTimeoutError(TrialError):
    """``tests/test.sh`` ran past ``[verifier].timeout_sec``; there is no reward."""


class RewardFileNotFoundError(TrialError):
    """The verifier wrote neither ``/logs/verifier/reward.json`` nor ``reward.txt``."""


class RewardFileEmptyError(TrialError):
    """The reward file exists but is empty."""


class VerifierOutputParseError(TrialError):
    """The reward file holds something other than a finite number (or flat numeric map)."""


class AddTestsDirError(TrialError):
    """Uploading ``tests/`` into the container failed."""


class EngineUnavailableError(TrialError):
    """The Docker engine stopped answering (connection refused or aborted, socket
    gone, a 5xx from the daemon, a timeout). An infrastructure fault, not the task's:
    rollouts end as ``internal_error``; the engine address and the phase are named."""

    def __init__(self, engine: str, detail: str = "", *, phase: str | None = None) -> None:
        self.engine = engine
        self.detail = detail
        self.phase = phase
        during = f" during the {phase} phase" if phase else ""
        suffix = f" ({detail})" if detail else ""
        super().__init__(f"Docker engine at {engine} stopped answering{during}{suffix}")

    def during(self, phase: str) -> EngineUnavailableError:
        """The same fault, naming the trial phase it interrupted."""
        return EngineUnavailableError(self.engine, self.detail, phase=phase)


class GpuUnavailableError(TrialError):
    """The task asks for GPUs (``[environment].gpus`` > 0) and the Docker engine has
    none to give (no ``nvidia`` runtime or GPU device); raised before the container starts."""


class CancelledError(TrialError):
    """The trial was cancelled (Ctrl-C, a rollout cancel or shutdown) before it finished."""


Phase = Literal["environment", "agent", "verifier", "none"]


@dataclass(frozen=True)
class ErrorPolicy:
    """Everything that follows from an exception type, in one row.

    Harbor's policy (retry it, still grade, reward valid), plus ours: the rollout
    error category it maps to (``RolloutErrorCategory`` values) and the phase it
    belongs to (a verifier-side error leaves the workflow's own result standing).
    """

    should_retry: bool
    should_grade: bool
    has_valid_reward: bool
    category: str = "agent_error"
    phase: Phase = "agent"


def _policy(retry: bool, grade: bool, valid: bool, category: str, phase: Phase) -> ErrorPolicy:
    return ErrorPolicy(retry, grade, valid, category, phase)


DEFAULT_POLICY = _policy(True, True, True, "agent_error", "agent")

# Harbor 0.26 models/trial/error_policy.py (retry, grade, valid reward), by exception
# class name, with the rollout category and phase. Nothing else lists exception names.
POLICIES: dict[str, ErrorPolicy] = {
    "EnvironmentStartTimeoutError": _policy(True, False, False, "timeout", "environment"),
    "EnvironmentStartError": _policy(True, False, False, "agent_error", "environment"),
    "AgentSetupTimeoutError": _policy(True, False, False, "timeout", "agent"),
    "AgentSetupError": _policy(True, False, False, "agent_error", "agent"),
    "HealthcheckError": _policy(True, False, False, "agent_error", "environment"),
    "SandboxBuildFailedError": _policy(True, False, False, "validation_error", "environment"),
    "AddTestsDirError": _policy(True, False, False, "agent_error", "verifier"),
    "DownloadVerifierDirError": _policy(True, False, False, "agent_error", "verifier"),
    "VerifierTimeoutError": _policy(False, True, False, "timeout", "verifier"),
    "RewardFileNotFoundError": _policy(False, True, False, "validation_error", "verifier"),
    "RewardFileEmptyError": _policy(False, True, False, "validation_error", "verifier"),
    "VerifierOutputParseError": _policy(False, True, False, "validation_error", "verifier"),
    "AgentTimeoutError": _policy(False, True, True, "timeout", "agent"),
    "NonZeroAgentExitCodeError": _policy(False, True, True, "agent_error", "agent"),
    "CancelledError": _policy(False, False, False, "agent_error", "none"),
    # Ours. Infrastructure faults: nothing in the container can be trusted to grade,
    # and a trainer may retry them elsewhere.
    "EngineUnavailableError": _policy(True, False, False, "internal_error", "none"),
    # A Ray node died (or left) with the trial on it (harbor_exec.executors.ray).
    "RayNodeLostError": _policy(True, False, False, "internal_error", "none"),
    # The task cannot run here as written (Harbor refuses these too).
    "GpuUnavailableError": _policy(False, False, False, "validation_error", "environment"),
    "FileNotFoundError": _policy(True, True, True, "validation_error", "agent"),
    "TaskConfigError": _policy(False, False, False, "validation_error", "environment"),
}


# Sandbox-provider failures the Osmosis protocol counts as ``http_error``, recognised
# by class name (``protocol.categorize_exception``) so that no provider SDK is imported.
PROVIDER_ERROR_TYPES: frozenset[str] = frozenset(
    {
        "SandboxConnectionException",
        "SandboxRateLimitException",
        "PoolStateStoreUnavailableException",
    }
)
# ... only with one of the protocol's provider HTTP statuses.
PROVIDER_API_ERROR_TYPES: frozenset[str] = frozenset({"SandboxApiException", "SandboxAPIError"})


def policy_for(exception_type: str) -> ErrorPolicy:
    """The policy for ``exception_type``; unlisted types get Harbor's default."""
    return POLICIES.get(exception_type, DEFAULT_POLICY)
