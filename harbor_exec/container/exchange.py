"""The files host and container exchange, and where they live in the container.

One definition for both sides: the host writes ``rollout.json`` with these
models and reads ``sample.json`` / ``reward.json`` / ``grader_error.json`` back
with them; the runner (``harbor_exec.container.runner``, inside the container) reads and
writes the same. Standard library and pydantic only: this runs in containers.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, field_validator

from harbor_exec.errors import HarborExecError

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

#: The read-only runtime (``harbor_exec.sandbox.runtime_volume``): harbor-exec's own
#: interpreter, init and keep-alive, the same in every image.
RUNTIME_MOUNT: Final = "/opt/harbor-exec-runtime"
RUNTIME_PYTHON_VERSION: Final = "3.13"
RUNTIME_PYTHON: Final = f"{RUNTIME_MOUNT}/python/bin/python3"
RUNTIME_LIB: Final = f"{RUNTIME_MOUNT}/lib"
RUNTIME_LOADER: Final = f"{RUNTIME_LIB}/ld-linux-x86-64.so.2"
RUNTIME_BUSYBOX: Final = f"{RUNTIME_MOUNT}/bin/busybox"
RUNTIME_TINI: Final = f"{RUNTIME_MOUNT}/bin/tini"
RUNTIME_SETPRIV: Final = f"{RUNTIME_MOUNT}/bin/setpriv"
#: Debian's tmux, for Harbor's terminus-2 (which drives the container through tmux).
RUNTIME_TMUX: Final = f"{RUNTIME_MOUNT}/bin/tmux"
#: The bundle's dependency environment (one read-only volume per requirement set);
#: the runtime's site-packages name ``DEPS_SITE`` in a ``.pth`` file.
DEPS_MOUNT: Final = "/opt/harbor-exec-deps"
DEPS_SITE: Final = f"{DEPS_MOUNT}/site"
#: An in-container native agent's prebuilt layer (``harbor_exec.agents.native.layer``):
#: its programs in ``bin/``, its Python packages in ``site/``, mounted read-only.
AGENT_MOUNT: Final = "/opt/harbor-exec-agent"
AGENT_SITE: Final = f"{AGENT_MOUNT}/site"
AGENT_BIN: Final = f"{AGENT_MOUNT}/bin"
#: Where a bundle's own code lives in the container (placed per trial).
BUNDLE_ROOT: Final = "/opt/harbor-exec"
USER_CODE_DIR: Final = f"{BUNDLE_ROOT}/user"
MANIFEST_PATH: Final = f"{BUNDLE_ROOT}/manifest.json"
#: The bundled grader's own copy of the bundle, placed as a fresh tree (whatever the
#: agent left at this path is replaced) after the agent's processes are killed: the
#: agent's ``USER_CODE_DIR`` is never on the grader's import path.
GRADER_DIR: Final = f"{BUNDLE_ROOT}/grader"
GRADER_CODE_DIR: Final = f"{GRADER_DIR}/code"
GRADER_MANIFEST_PATH: Final = f"{GRADER_DIR}/manifest.json"
#: The grader's working directory: empty, nothing of the task's workdir.
GRADER_WORKDIR: Final = f"{GRADER_DIR}/cwd"
#: The rollout's model relay directory, mounted read-only.
RELAY_DIR: Final = "/run/harbor-exec/relay"
RELAY_SOCKET: Final = f"{RELAY_DIR}/relay.sock"

INPUT_VERSION: Final = 1
SAMPLE_FIELDS: Final = ("messages", "reward", "remove_sample", "metrics", "extra_fields")


def in_logs(relative: str) -> str:
    """The container path of a file under ``/logs``."""
    return f"{LOGS_DIR}/{relative}"


# --------------------------------------------------------------------------- bounded JSON

#: Every JSON document that comes out of a container is hostile: bounded in bytes
#: and nesting BEFORE it is parsed (a 200,000-deep array makes ``json.loads`` raise
#: RecursionError, and pydantic or ``repr`` recurse on what it returns).
MAX_EXCHANGE_JSON_BYTES: Final = 4 * 2**20
MAX_EXCHANGE_JSON_DEPTH: Final = 128

# A JSON string token (unrolled loop: no backtracking on long strings), and a bracket.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


class ExchangeJSONError(HarborExecError, ValueError):
    """A JSON document from a container is too big, too deep, or not JSON."""


def json_depth(text: str, limit: int) -> int:
    """How deep ``text`` nests arrays and objects, counting no further than ``limit + 1``.

    Brackets inside strings do not count; for text that is not JSON the answer is
    only an estimate (parsing it fails anyway).
    """
    if text.count("[") + text.count("{") <= limit:  # the common case: too few to matter
        return min(text.count("[") + text.count("{"), limit)
    depth = deepest = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth -= 1
    return deepest


def load_exchange_json(
    data: bytes | str,
    what: str,
    *,
    max_bytes: int = MAX_EXCHANGE_JSON_BYTES,
    max_depth: int = MAX_EXCHANGE_JSON_DEPTH,
) -> Any:
    """Parse ``data`` (``what`` names it in errors) after checking its size and depth.

    Raises ``ExchangeJSONError`` (a ValueError) for anything it refuses; never
    RecursionError. NaN and infinities are refused: JSON has no such values.
    """
    size = len(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    if size > max_bytes:
        raise ExchangeJSONError(f"{what} is {size} bytes; at most {max_bytes} are read")
    try:
        text = data if isinstance(data, str) else data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ExchangeJSONError(f"{what} is not UTF-8: {exc}") from None
    if json_depth(text, max_depth) > max_depth:
        raise ExchangeJSONError(f"{what} nests deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # RecursionError: a depth estimate was off
        raise ExchangeJSONError(f"{what} is not valid JSON: {str(exc)[:200]}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


# --------------------------------------------------------------------------- the sample's frame

#: The runner hands the sample to the host on the stdout of its exec, as one frame:
#: ``SAMPLE_FRAME_MARKER <length>\n<sample.json bytes>\n``. The host takes the first
#: complete frame of what the exec printed when it ended; nothing written later
#: (a detached process, a rewritten ``sample.json``) changes it. No nonce: the
#: workflow runs inside the runner's process and could read one, and only the agent
#: can write to that stdout anyway (the workflow's own fd 1 goes to ``runner.txt``),
#: so the frame proves *when* the sample was taken, not who wrote it. That is why the
#: agent's ``reward`` and ``remove_sample`` are never believed.
SAMPLE_FRAME_MARKER: Final = b"\x1eharbor-exec:sample:v1 "


def frame_sample(payload: bytes) -> bytes:
    """``payload`` (a ``sample.json`` document) as the runner's stdout frame."""
    return b"\n" + SAMPLE_FRAME_MARKER + str(len(payload)).encode() + b"\n" + payload + b"\n"


def unframe_sample(output: bytes, max_bytes: int = MAX_EXCHANGE_JSON_BYTES) -> bytes | None:
    """The payload of the first frame in ``output``; None when it has no complete one
    (or the first declares more than ``max_bytes``). Later frames never count."""
    start = output.find(SAMPLE_FRAME_MARKER)
    if start < 0:
        return None
    start += len(SAMPLE_FRAME_MARKER)
    newline = output.find(b"\n", start, start + 20)
    length_text = output[start:newline] if newline > 0 else b""
    if not length_text.isdigit() or int(length_text) > max_bytes:
        return None
    payload = output[newline + 1 : newline + 1 + int(length_text)]
    return payload if len(payload) == int(length_text) else None


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
    "AGENT_BIN",
    "AGENT_INPUT",
    "AGENT_MOUNT",
    "AGENT_SAMPLE",
    "AGENT_SITE",
    "DEPS_MOUNT",
    "DEPS_SITE",
    "GRADER_CODE_DIR",
    "GRADER_DIR",
    "GRADER_ERROR",
    "GRADER_INPUT",
    "GRADER_MANIFEST_PATH",
    "GRADER_WORKDIR",
    "LOGS_DIR",
    "MANIFEST_PATH",
    "MAX_EXCHANGE_JSON_BYTES",
    "MAX_EXCHANGE_JSON_DEPTH",
    "RELAY_DIR",
    "RELAY_SOCKET",
    "REWARD_JSON",
    "RUNNER_OUTPUT",
    "RUNTIME_BUSYBOX",
    "RUNTIME_LIB",
    "RUNTIME_LOADER",
    "RUNTIME_MOUNT",
    "RUNTIME_PYTHON",
    "RUNTIME_PYTHON_VERSION",
    "RUNTIME_SETPRIV",
    "RUNTIME_TINI",
    "RUNTIME_TMUX",
    "SAMPLE_FRAME_MARKER",
    "TESTS_DIR",
    "USER_CODE_DIR",
    "VERIFIER_SAMPLE",
    "ErrorDetail",
    "ErrorFile",
    "ExchangeJSONError",
    "RelayInput",
    "RewardFile",
    "RolloutInput",
    "SampleFile",
    "frame_sample",
    "in_logs",
    "json_depth",
    "load_exchange_json",
    "unframe_sample",
]
