"""Every named error of the trial engine, in one place.

Two families live here:

* user-input errors (``TaskError`` and friends): raised before anything runs,
  each message names the task, the file and the field at fault;
* trial errors: the exception names Harbor records in ``result.json``
  (``exception_info.exception_type``). Their class names are part of our
  result contract, so they match Harbor 0.26 exactly, and ``POLICIES`` carries
  Harbor's error policy for each (retry, grade, valid reward).
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class ErrorPolicy:
    """Harbor's policy for an exception type: retry it, still grade, reward valid."""

    should_retry: bool
    should_grade: bool
    has_valid_reward: bool


_RETRY_NO_GRADE = ErrorPolicy(should_retry=True, should_grade=False, has_valid_reward=False)
_GRADE_INVALID = ErrorPolicy(should_retry=False, should_grade=True, has_valid_reward=False)
_GRADE_VALID = ErrorPolicy(should_retry=False, should_grade=True, has_valid_reward=True)
_NO_GRADE = ErrorPolicy(should_retry=False, should_grade=False, has_valid_reward=False)
DEFAULT_POLICY = ErrorPolicy(should_retry=True, should_grade=True, has_valid_reward=True)

# Harbor 0.26 models/trial/error_policy.py, by exception class name.
POLICIES: dict[str, ErrorPolicy] = {
    "EnvironmentStartTimeoutError": _RETRY_NO_GRADE,
    "EnvironmentStartError": _RETRY_NO_GRADE,
    "AgentSetupTimeoutError": _RETRY_NO_GRADE,
    "AgentSetupError": _RETRY_NO_GRADE,
    "HealthcheckError": _RETRY_NO_GRADE,
    "SandboxBuildFailedError": _RETRY_NO_GRADE,
    "AddTestsDirError": _RETRY_NO_GRADE,
    "DownloadVerifierDirError": _RETRY_NO_GRADE,
    "VerifierTimeoutError": _GRADE_INVALID,
    "RewardFileNotFoundError": _GRADE_INVALID,
    "RewardFileEmptyError": _GRADE_INVALID,
    "VerifierOutputParseError": _GRADE_INVALID,
    "AgentTimeoutError": _GRADE_VALID,
    "NonZeroAgentExitCodeError": _GRADE_VALID,
    "CancelledError": _NO_GRADE,
    # Ours: infrastructure faults; nothing in the container can be trusted to grade.
    "EngineUnavailableError": _RETRY_NO_GRADE,
    "GpuUnavailableError": _NO_GRADE,
}


def policy_for(exception_type: str) -> ErrorPolicy:
    """Harbor's policy for ``exception_type``; unlisted types get Harbor's default."""
    return POLICIES.get(exception_type, DEFAULT_POLICY)
