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
from enum import StrEnum


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


class DiskBudgetExceededError(TrialError):
    """The agent's container wrote more than its disk budget (``[environment].storage_mb``,
    else the operator's ``--default-storage-mb``); its processes were killed and the
    trial was verified anyway, as after an agent timeout."""


class AgentOutputLimitError(TrialError):
    """What the agent left in ``/logs`` or its artifacts went over the copy-back budget
    (bytes, files, directories or entries); the rest was not read. The agent's fault:
    the verifier's output was read first, so its reward stands."""


class AgentEndedContainerError(TrialError):
    """The agent's container stopped (``kill 1``, its init made to exit) after it had
    started and before the verifier was done. The agent's doing, never the
    environment's: it is restarted (every process gone, files kept) and verified."""


class StepPreparationError(TrialError):
    """A later step of a multi-step task could not be prepared (its ``setup.sh``, its
    healthcheck or its workdir) in the container an earlier step's agent had: the
    agent's doing (it may have broken the container on purpose). That step and every
    step it stops count 0 in the trial's reward, so no step can be dropped from the mean."""


class HealthcheckError(TrialError):
    """``[environment.healthcheck]`` kept failing after its start period (Harbor's)."""


class AgentSetupError(TrialError):
    """The agent could not be installed or prepared in the container."""


class AgentSetupTimeoutError(TrialError):
    """A native agent's setup (``agent_setup_timeout_sec``) took too long."""


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

    def __init__(self, engine: str, detail: str = "", *, phase: TrialPhase | None = None) -> None:
        self.engine = engine
        self.detail = detail
        self.phase = phase
        during = f" during the {phase} phase" if phase else ""
        suffix = f" ({detail})" if detail else ""
        super().__init__(f"Docker engine at {engine} stopped answering{during}{suffix}")

    def during(self, phase: TrialPhase) -> EngineUnavailableError:
        """The same fault, naming the trial phase it interrupted."""
        return EngineUnavailableError(self.engine, self.detail, phase=phase)


class GpuUnavailableError(TrialError):
    """The task asks for GPUs (``[environment].gpus`` > 0) and the Docker engine has
    none to give (no ``nvidia`` runtime or GPU device); raised before the container starts."""


class CancelledError(TrialError):
    """The trial was cancelled (Ctrl-C, a rollout cancel or shutdown) before it finished."""


class RayNodeLostError(HarborExecError):
    """The Ray node running a trial died or left the cluster."""


class RayUnavailableError(HarborExecError):
    """The Ray cluster cannot be reached (or has no node offering trial slots)."""


class TrialPhase(StrEnum):
    """The phases of a trial, in order, as progress callbacks report them and error
    messages name them ("during the agent phase"); ``DONE`` ends every trial."""

    ENVIRONMENT = "environment"
    AGENT = "agent"
    VERIFIER = "verifier"
    TEARDOWN = "teardown"  # logs and artifacts copied back, containers removed
    DONE = "done"


@dataclass(frozen=True)
class ErrorPolicy:
    """Everything that follows from an exception type, in one row.

    Harbor's policy (retry it, still grade, reward valid), plus ours: the rollout
    error category it maps to (``RolloutErrorCategory`` values) and the phase it
    belongs to (a verifier-side error leaves the workflow's own result standing;
    None: no phase's fault, e.g. a cancel or an infrastructure fault).
    """

    should_retry: bool
    should_grade: bool
    has_valid_reward: bool
    category: str = "agent_error"
    phase: TrialPhase | None = TrialPhase.AGENT


def _policy(
    retry: bool, grade: bool, valid: bool, category: str, phase: TrialPhase | None
) -> ErrorPolicy:
    return ErrorPolicy(retry, grade, valid, category, phase)


_ENV, _AGENT, _VERIFIER = TrialPhase.ENVIRONMENT, TrialPhase.AGENT, TrialPhase.VERIFIER
DEFAULT_POLICY = _policy(True, True, True, "agent_error", _AGENT)

# Harbor 0.26 models/trial/error_policy.py (retry, grade, valid reward), by exception
# class name, with the rollout category and phase. Nothing else lists exception names.
POLICIES: dict[str, ErrorPolicy] = {
    "EnvironmentStartTimeoutError": _policy(True, False, False, "timeout", _ENV),
    "EnvironmentStartError": _policy(True, False, False, "agent_error", _ENV),
    "AgentSetupTimeoutError": _policy(True, False, False, "timeout", _AGENT),
    "AgentSetupError": _policy(True, False, False, "agent_error", _AGENT),
    "HealthcheckError": _policy(True, False, False, "agent_error", _ENV),
    "SandboxBuildFailedError": _policy(True, False, False, "validation_error", _ENV),
    "AddTestsDirError": _policy(True, False, False, "agent_error", _VERIFIER),
    "DownloadVerifierDirError": _policy(True, False, False, "agent_error", _VERIFIER),
    "VerifierTimeoutError": _policy(False, True, False, "timeout", _VERIFIER),
    "RewardFileNotFoundError": _policy(False, True, False, "validation_error", _VERIFIER),
    "RewardFileEmptyError": _policy(False, True, False, "validation_error", _VERIFIER),
    "VerifierOutputParseError": _policy(False, True, False, "validation_error", _VERIFIER),
    "AgentTimeoutError": _policy(False, True, True, "timeout", _AGENT),
    "NonZeroAgentExitCodeError": _policy(False, True, True, "agent_error", _AGENT),
    # Ours: the agent flooded its outputs; graded, and the verifier's reward is valid.
    "AgentOutputLimitError": _policy(False, True, True, "agent_error", _AGENT),
    "CancelledError": _policy(False, False, False, "agent_error", None),
    # Ours. The agent ended its own (started, healthy) container: not retried (it would
    # do it again), graded in the restarted container, so the verifier's reward stands.
    "AgentEndedContainerError": _policy(False, True, True, "agent_error", _AGENT),
    # Ours. The agent filled its disk budget: its own doing, like a timeout (not
    # retried, it would do it again; graded, so the policy learns what it cost).
    "DiskBudgetExceededError": _policy(False, True, True, "agent_error", _AGENT),
    # Ours. A later step could not be prepared after an earlier agent ran: the agent's
    # doing; the steps it stops count 0, so the trial's reward stands.
    "StepPreparationError": _policy(False, True, True, "agent_error", _AGENT),
    # Ours. Infrastructure faults: nothing in the container can be trusted to grade,
    # and a trainer may retry them elsewhere.
    "EngineUnavailableError": _policy(True, False, False, "internal_error", None),
    # A Ray node died (or left) with the trial on it (harbor_exec.executors.ray).
    "RayNodeLostError": _policy(True, False, False, "internal_error", None),
    # The task cannot run here as written (Harbor refuses these too).
    "GpuUnavailableError": _policy(False, False, False, "validation_error", _ENV),
    "FileNotFoundError": _policy(True, True, True, "validation_error", _AGENT),
    "TaskConfigError": _policy(False, False, False, "validation_error", _ENV),
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


def is_exception(exception_type: str | None, error: type[BaseException]) -> bool:
    """Whether a recorded ``exception_type`` (a class name, as in ``result.json``)
    names ``error``; compare through this, never against a name written out."""
    return exception_type == error.__name__
