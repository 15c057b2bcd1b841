"""The files host and container exchange, and where they live in the container.

One definition for both sides: the host writes ``rollout.json`` with these
models and reads ``sample.json`` / ``reward.json`` / ``grader_error.json`` back
with them; the runner (``harbor_exec.container.runner``, inside the container) reads and
writes the same. Standard library and pydantic only: this runs in containers.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, ConfigDict, field_validator

# --------------------------------------------------------------------------- container paths

LOGS_DIR: Final = "/logs"
TESTS_DIR: Final = "/tests"
#: Relative to the logs dir: what the agent reads and writes.
AGENT_INPUT: Final = "agent/rollout.json"
AGENT_SAMPLE: Final = "agent/sample.json"
RUNNER_OUTPUT: Final = "agent/runner.txt"
#: Relative to the logs dir: what the grader writes.
REWARD_JSON: Final = "verifier/reward.json"
VERIFIER_SAMPLE: Final = "verifier/sample.json"
GRADER_ERROR: Final = "verifier/grader_error.json"
#: Relative to the tests dir: the grader's input (with the label).
GRADER_INPUT: Final = "rollout.json"

#: Where a bundle lives in the container (the venv comes from the dependency layer).
BUNDLE_ROOT: Final = "/opt/harbor-exec"
VENV_PYTHON: Final = f"{BUNDLE_ROOT}/venv/bin/python"
USER_CODE_DIR: Final = f"{BUNDLE_ROOT}/user"
MANIFEST_PATH: Final = f"{BUNDLE_ROOT}/manifest.json"
#: The rollout's model relay directory, mounted read-only.
RELAY_DIR: Final = "/run/harbor-exec/relay"
RELAY_SOCKET: Final = f"{RELAY_DIR}/relay.sock"

INPUT_VERSION: Final = 1
SAMPLE_FIELDS: Final = ("messages", "reward", "remove_sample", "metrics", "extra_fields")


def in_logs(relative: str) -> str:
    """The container path of a file under ``/logs``."""
    return f"{LOGS_DIR}/{relative}"


# --------------------------------------------------------------------------- models


class RelayInput(BaseModel):
    """``rollout.json``'s ``relay``: the model relay's socket in the container and URL path."""

    model_config = ConfigDict(extra="ignore")

    socket: str
    path: str = ""

    @field_validator("path")
    @classmethod
    def _origin_path(cls, value: str) -> str:
        if value and not value.startswith("/"):
            raise ValueError(f"relay.path must be empty or start with '/': {value!r}")
        return value.rstrip("/")


class RolloutInput(BaseModel):
    """``rollout.json``: the agent's copy has no label; the grader's has it.

    With ``relay``, the model is reached through the host's per-rollout relay on
    that socket and ``api_key`` is the rollout's relay token, not the model's key.
    """

    model_config = ConfigDict(extra="ignore")

    version: int = INPUT_VERSION
    rollout_id: str
    prompt: list[dict[str, Any]]
    label: str | None = None
    metadata: dict[str, Any] | None = None
    chat_completions_url: str = ""
    api_key: str | None = None
    relay: RelayInput | None = None


class SampleFile(BaseModel):
    """``sample.json`` in its success form (the agent's, or the grader's changed copy)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    messages: list[dict[str, Any]] | None  # None: the workflow produced no sample
    reward: float | None = None
    remove_sample: bool = False
    metrics: dict[str, Any] = {}
    extra_fields: dict[str, Any] = {}


class ErrorDetail(BaseModel):
    """Why the runner failed: written instead of a sample (agent) or beside no reward
    (grader), as ``{"error": {...}}``."""

    model_config = ConfigDict(extra="ignore")

    type: str = "Error"
    message: str = ""
    category: str = "agent_error"
    phase: str = "workflow"  # setup | workflow | grader
    traceback: str = ""


class ErrorFile(BaseModel):
    """``sample.json``'s error form, and ``grader_error.json``."""

    model_config = ConfigDict(extra="ignore")

    error: ErrorDetail


class RewardFile(BaseModel):
    """``reward.json`` as the bundled grader writes it."""

    reward: float


__all__ = [
    "AGENT_INPUT",
    "AGENT_SAMPLE",
    "GRADER_ERROR",
    "GRADER_INPUT",
    "LOGS_DIR",
    "MANIFEST_PATH",
    "RELAY_DIR",
    "RELAY_SOCKET",
    "REWARD_JSON",
    "RUNNER_OUTPUT",
    "TESTS_DIR",
    "USER_CODE_DIR",
    "VENV_PYTHON",
    "VERIFIER_SAMPLE",
    "ErrorDetail",
    "ErrorFile",
    "RelayInput",
    "RewardFile",
    "RolloutInput",
    "SampleFile",
    "in_logs",
]
