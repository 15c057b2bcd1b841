"""Container runner: ``python -m harbor_exec.container.runner agent|grade|forward``.

Runs inside task containers (Python >= 3.11) and imports only the standard
library, pydantic and ``harbor_exec.authoring``. The bundle's manifest
(``--manifest``, default ``/opt/harbor-exec/manifest.json``) names the workflow,
the grader and their configs as ``module:attr``; only those four fields are read.
They may name classes and configs written against osmosis-ai 0.3.8's SDK: those run
through ``harbor_exec.compat.osmosis`` (osmosis-ai from the bundle's dependencies).

``agent``
    reads ``<logs>/agent/rollout.json``::

        {"version": 1, "rollout_id": "...", "prompt": [...], "metadata": {...} | null,
         "chat_completions_url": "http://...", "api_key": "..." | null}

    (any ``label`` there is ignored: the agent never sees it), runs a fresh
    workflow instance with a deep copy of its config under a ``RolloutContext``
    (chat URL, key, rollout id) with ``<logs>/artifacts`` as ``artifacts_dir``,
    and coerces its return value as ``LocalBackend`` does (``AgentWorkflowOutput``,
    a message list, or None for the registered sample source). It ALWAYS writes
    ``<logs>/agent/sample.json``. On success::

        {"messages": [...], "reward": null, "remove_sample": false,
         "metrics": {...}, "extra_fields": {...}}

    On failure, instead, the error form (no ``messages`` key)::

        {"error": {"type": "ValueError", "message": "...",
                   "category": "timeout" | "validation_error" | "http_error" | "agent_error",
                   "phase": "setup" | "workflow" | "grader", "traceback": "..."}}

    With the optional ``relay`` object::

        "relay": {"socket": "/run/harbor-exec/relay/relay.sock", "path": "/v1"}

    the model is reached through the host's per-rollout relay
    (``harbor_exec.network.relay``) on that unix socket, and ``api_key`` is the
    rollout's relay token, not the model's key; ``chat_completions_url`` is then
    ignored. Before the workflow starts, the runner listens on a free port of
    127.0.0.1 inside the container and pipes every connection's bytes both ways
    to the socket (no HTTP parsing here); the workflow's chat URL is
    ``http://127.0.0.1:<port><path>``. The listener and its connections close
    when the workflow ends. A missing socket is a setup failure.

    With ``--sample-to-stdout`` (how the host runs it) the same bytes also go, as
    the last thing the runner does, to its stdout as one frame
    (``exchange.frame_sample``); the workflow's own stdout goes to stderr. The host
    takes the sample from that frame when the exec ends, so nothing the workflow
    leaves running can change it later; ``sample.json`` in the container is only a
    copy. A sample over ``MAX_EXCHANGE_JSON_BYTES`` as JSON becomes the error form.

    A host detects agent failure by a non-zero exit code or, reading only the
    file, by the presence of the ``error`` key. ``category`` follows the SDK's
    ``categorize_exception``; ``phase`` is ``setup`` when the run never started
    (manifest, input file or ref at fault). The rollout's API key is replaced by
    ``[REDACTED]`` in messages and tracebacks.

``grade``
    reads ``<tests>/rollout.json`` (the same schema, WITH ``label``) and
    ``<logs>/agent/sample.json`` (the host places its own copy there first), runs a
    fresh grader with a ``GraderContext`` (label, sample without the agent's
    ``reward`` and ``remove_sample``: those are the grader's to decide, metadata,
    ``<logs>/artifacts``), then writes
    ``<logs>/verifier/reward.json`` as ``{"reward": <float>}``. When the grader
    changed anything but the reward (``remove_sample``, metrics, extra_fields,
    messages) it also writes ``<logs>/verifier/sample.json`` (the full sample in the
    agent's schema, reward included), so nothing it decided is lost. A grader that
    removes the sample without a reward gets ``{"reward": 0.0}`` (the wire nulls a
    removed sample's reward anyway). On any failure (no or failed agent sample,
    grader exception, no reward set) nothing is written to ``reward.json``, so the
    verifier reports ``RewardFileNotFoundError``; the message goes to stderr and,
    in the error form above, to ``<logs>/verifier/grader_error.json``.

``forward``
    for an agent that runs in the container on its own (Harbor's mini-swe-agent):
    listens on a free port of 127.0.0.1, prints the port on stdout, detaches (a new
    session, stdio on ``/dev/null``) and pipes every connection to the relay socket
    (``--socket``, default ``/run/harbor-exec/relay/relay.sock``) until it is killed
    (the host's kill of the agent's processes after its phase). Standard library
    only. Exit 2 when the socket is missing.

Exit codes: 0 success; 1 the workflow or grader failed; 2 the job could not
start (bad arguments, unreadable manifest or input file, a ref that does not
import, nothing to grade).

``--code-dir DIR`` (repeatable) appends a directory of the bundle's code to
``sys.path``. The host starts the bundled grader as ``python -I`` (no ``PYTHON*``
variables, no user site, no cwd or script directory on the path) from an empty
working directory, with its own fresh copy of the bundle as ``--code-dir``.

Paths: ``--logs-dir`` (env ``HARBOR_EXEC_LOGS_DIR``, default ``/logs``),
``--tests-dir`` (``HARBOR_EXEC_TESTS_DIR``, default ``/tests``) and
``--manifest`` (``HARBOR_EXEC_MANIFEST``). Every file is written atomically
(temporary file, then rename), so a reader never sees half a JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from pydantic import BaseModel, ConfigDict, ValidationError

from harbor_exec.authoring import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    Grader,
    GraderConfig,
    GraderContext,
    RolloutContext,
    RolloutErrorCategory,
    RolloutSample,
    resolve_import_path,
    run_workflow_once,
)
from harbor_exec.compat.osmosis import (
    as_grader_class,
    as_workflow_class,
    is_grader_config,
    is_workflow_config,
)
from harbor_exec.container.exchange import (
    AGENT_INPUT,
    AGENT_SAMPLE,
    GRADER_ERROR,
    GRADER_INPUT,
    INPUT_VERSION,
    MANIFEST_PATH,
    MAX_EXCHANGE_JSON_BYTES,
    RELAY_SOCKET,
    REWARD_JSON,
    SAMPLE_FIELDS,
    VERIFIER_SAMPLE,
    ErrorDetail,
    ErrorFile,
    ExchangeJSONError,
    RelayInput,
    RolloutInput,
    SampleFile,
    frame_sample,
    load_exchange_json,
)
from harbor_exec.container.forward import (
    ForwarderThread,
    RelayForwarder,
    run_forward,
)
from harbor_exec.container.redaction import redact
from harbor_exec.errors import HarborExecError
from harbor_exec.protocol import categorize_exception

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_SETUP",
    "ManifestRefs",
    "RelayForwarder",
    "RelayInput",
    "RolloutInput",
    "RunnerPaths",
    "main",
    "run_forward",
]

logger = logging.getLogger("harbor_exec.container.runner")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_SETUP = 2

DEFAULT_MANIFEST = MANIFEST_PATH
MANIFEST_ENV = "HARBOR_EXEC_MANIFEST"
LOGS_DIR_ENV = "HARBOR_EXEC_LOGS_DIR"
TESTS_DIR_ENV = "HARBOR_EXEC_TESTS_DIR"

_TRACEBACK_LINES = 60


class ManifestRefs(BaseModel):
    """The part of the bundle manifest the runner needs; other fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    workflow: str | None = None
    grader: str | None = None
    workflow_config: str | None = None
    grader_config: str | None = None


@dataclass(frozen=True, slots=True)
class RunnerPaths:
    """Every file the runner touches, derived from three roots."""

    manifest: Path
    logs_dir: Path
    tests_dir: Path

    @property
    def agent_input(self) -> Path:
        return self.logs_dir / AGENT_INPUT

    @property
    def agent_sample(self) -> Path:
        return self.logs_dir / AGENT_SAMPLE

    @property
    def grader_input(self) -> Path:
        return self.tests_dir / GRADER_INPUT

    @property
    def reward(self) -> Path:
        return self.logs_dir / REWARD_JSON

    @property
    def verifier_sample(self) -> Path:
        return self.logs_dir / VERIFIER_SAMPLE

    @property
    def grader_error(self) -> Path:
        return self.logs_dir / GRADER_ERROR

    @property
    def artifacts_dir(self) -> Path:
        return self.logs_dir / "artifacts"


class SetupError(HarborExecError):
    """The job could not start: the message says which file or ref, and why."""


class _Terminated(BaseException):
    """SIGTERM arrived (the host's deadline or a cancel); unwinds like KeyboardInterrupt."""


# --------------------------------------------------------------------------- helpers


def _write_json(path: Path, payload: Any) -> None:
    """Write ``payload`` atomically; NaN/inf are refused (JSON has no such values)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(payload, ensure_ascii=False, allow_nan=False, indent=1)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(data + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SetupError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SetupError(f"{what} {path} is unreadable: {exc}") from exc


def _read_manifest(path: Path) -> ManifestRefs:
    try:
        return ManifestRefs.model_validate(_read_json(path, "bundle manifest"))
    except ValidationError as exc:
        raise SetupError(f"bundle manifest {path} is invalid: {exc}") from exc


def _read_input(path: Path) -> RolloutInput:
    data = _read_json(path, "rollout input")
    try:
        rollout = RolloutInput.model_validate(data)
    except ValidationError as exc:
        raise SetupError(f"rollout input {path} is invalid: {exc}") from exc
    if rollout.version != INPUT_VERSION:
        raise SetupError(
            f"rollout input {path} has version {rollout.version}; this runner reads "
            f"version {INPUT_VERSION}. Rebuild the bundle with the host's harbor-exec."
        )
    return rollout


def _resolve(ref: str, field: str, kind: type, manifest: Path) -> Any:
    """Import ``ref`` and check what it is; a class for entry points, an instance for configs."""
    try:
        obj = resolve_import_path(ref)
    except Exception as exc:
        raise SetupError(
            f"{field} {ref!r} from {manifest} does not import: {type(exc).__name__}: {exc}"
        ) from exc
    if kind in (AgentWorkflow, Grader):
        # Classes written against osmosis-ai's SDK come back wrapped (compat.osmosis).
        adapted = as_workflow_class(obj) if kind is AgentWorkflow else as_grader_class(obj)
        if adapted is None:
            raise SetupError(
                f"{field} {ref!r} from {manifest} is {obj!r}, not a subclass of {kind.__name__}"
            )
        return adapted
    elif not (is_workflow_config(obj) if kind is AgentWorkflowConfig else is_grader_config(obj)):
        raise SetupError(
            f"{field} {ref!r} from {manifest} is a {type(obj).__name__}, not a "
            f"{kind.__name__} instance (define one at module level)"
        )
    return obj


def _artifacts_dir(path: Path) -> Path | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        logger.warning("artifacts dir %s is unusable; running without one", path)
        return None
    return path if os.access(path, os.W_OK) else None


def _error_payload(exc: BaseException, phase: str, secret: str | None) -> dict[str, Any]:
    if isinstance(exc, _Terminated):
        kind, category = "Terminated", RolloutErrorCategory.AGENT_ERROR
        message = "the runner was terminated (SIGTERM) before it finished: deadline or cancel"
    else:
        kind, category = type(exc).__name__, categorize_exception(exc)
        message = str(exc) or kind
    lines = traceback.format_exception(exc)
    trace = "".join(lines).splitlines()[-_TRACEBACK_LINES:]
    detail = ErrorDetail(
        type=kind,
        message=redact(message, [secret]),
        category=str(category),
        phase=phase,
        traceback=redact("\n".join(trace), [secret]),
    )
    return ErrorFile(error=detail).model_dump(mode="json")


def _sample_payload(sample: RolloutSample | None) -> dict[str, Any]:
    if sample is None:  # the workflow produced none: a success without a sample
        return SampleFile(messages=None).model_dump(mode="json")
    safe = sample.json_safe_copy()
    return safe.model_dump(mode="json", include=set(SAMPLE_FIELDS))


# The settings that keep litellm from using the network (as harbor_exec.agents.native.config
# gives Harbor's own agents; repeated here: this module imports no host code).
LITELLM_OFFLINE_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_OFFLINE_MODE": "true"}


def _on_sigterm(_signum: int, _frame: FrameType | None) -> NoReturn:
    raise _Terminated


# --------------------------------------------------------------------------- agent


async def _run_workflow(
    workflow: AgentWorkflow[Any], context: AgentWorkflowContext[Any], rollout: RolloutInput
) -> RolloutSample | None:
    forwarder: ForwarderThread | None = None
    chat_url = rollout.chat_completions_url
    if rollout.relay is not None:
        forwarder = ForwarderThread(rollout.relay.socket)
        port = forwarder.start()
        chat_url = f"http://127.0.0.1:{port}{rollout.relay.path}"
    try:
        rollout_context = RolloutContext(
            chat_completions_url=chat_url, api_key=rollout.api_key, rollout_id=rollout.rollout_id
        )
        return await run_workflow_once(workflow, context, rollout_context)
    finally:
        if forwarder is not None:
            forwarder.close()


def _sample_bytes(payload: dict[str, Any]) -> bytes:
    """``payload`` as ``sample.json``'s bytes; one the host would refuse to read (too
    big) becomes the error form, so host and file agree on what the agent produced."""
    data = (json.dumps(payload, ensure_ascii=False, allow_nan=False, indent=1) + "\n").encode()
    if len(data) <= MAX_EXCHANGE_JSON_BYTES:
        return data
    too_big = ValueError(
        f"the sample is {len(data)} bytes as JSON; at most {MAX_EXCHANGE_JSON_BYTES} are taken"
    )
    return _sample_bytes(_error_payload(too_big, "workflow", None))


def _write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _hand_over(paths: RunnerPaths, payload: dict[str, Any], frame_fd: int | None) -> None:
    """Write ``sample.json`` and, last of all, its frame on ``frame_fd`` (the host's copy)."""
    data = _sample_bytes(payload)
    if frame_fd is None:
        _write_bytes(paths.agent_sample, data)
        return
    with contextlib.suppress(OSError):  # only a copy now: the frame is what the host takes
        _write_bytes(paths.agent_sample, data)
    with contextlib.suppress(OSError), os.fdopen(frame_fd, "wb", closefd=True) as frame:
        frame.write(frame_sample(data))


def run_agent(paths: RunnerPaths, frame_fd: int | None = None) -> int:
    """The ``agent`` command; always leaves ``agent/sample.json`` behind and, with
    ``frame_fd``, hands the same bytes to the host there (see ``frame_sample``)."""
    secret: str | None = None
    phase = "setup"
    try:
        manifest = _read_manifest(paths.manifest)
        rollout = _read_input(paths.agent_input)
        secret = rollout.api_key
        if not manifest.workflow:
            raise SetupError(f"bundle manifest {paths.manifest} names no workflow")
        if rollout.relay is not None and not os.path.exists(rollout.relay.socket):
            raise SetupError(
                f"the model relay socket {rollout.relay.socket} does not exist "
                "(the host mounts it into the container)"
            )
        workflow_cls = _resolve(manifest.workflow, "workflow", AgentWorkflow, paths.manifest)
        config = None
        if manifest.workflow_config:
            config = _resolve(
                manifest.workflow_config, "workflow_config", AgentWorkflowConfig, paths.manifest
            )
        # A fresh instance and config copy per rollout, as LocalBackend does.
        config = copy.deepcopy(config)
        context: AgentWorkflowContext[Any] = AgentWorkflowContext(
            prompt=rollout.prompt,
            config=config,
            metadata=rollout.metadata,
            artifacts_dir=_artifacts_dir(paths.artifacts_dir),
        )
        phase = "workflow"
        workflow = workflow_cls(config)
        sample = asyncio.run(_run_workflow(workflow, context, rollout))
        _hand_over(paths, _sample_payload(sample), frame_fd)
    except (Exception, KeyboardInterrupt, _Terminated) as exc:
        payload = _error_payload(exc, phase, secret)
        _hand_over(paths, payload, frame_fd)
        print(f"harbor-exec runner: agent failed: {payload['error']['message']}", file=sys.stderr)
        print(payload["error"]["traceback"], file=sys.stderr)
        return EXIT_SETUP if phase == "setup" else EXIT_FAILED
    print(f"harbor-exec runner: sample written to {paths.agent_sample}")
    return EXIT_OK


# --------------------------------------------------------------------------- grade


def _load_agent_sample(path: Path, label: str | None) -> RolloutSample:
    try:
        data = load_exchange_json(path.read_bytes(), f"agent sample {path}")
    except FileNotFoundError:
        raise SetupError(f"agent sample {path} does not exist") from None
    except (OSError, ExchangeJSONError) as exc:
        raise SetupError(f"agent sample {path} is unreadable: {exc}") from exc
    if isinstance(data, dict) and "error" in data:
        error = data["error"] if isinstance(data["error"], dict) else {}
        raise SetupError(
            f"the agent phase failed ({error.get('type', 'error')}: "
            f"{error.get('message', '?')}), so {path} holds no sample to grade"
        )
    try:
        parsed = SampleFile.model_validate(data)
    except ValidationError as exc:
        raise SetupError(f"agent sample {path} is invalid: {exc}") from exc
    if parsed.messages is None:
        raise SetupError("No sample to grade: the workflow produced none")
    # The agent wrote this file: its reward and remove_sample are not the grader's
    # to see (the grader decides both), so they start unset.
    return RolloutSample(
        messages=parsed.messages,
        label=label,
        metrics=parsed.metrics,
        extra_fields=parsed.extra_fields,
    )


def _comparable(sample: RolloutSample) -> dict[str, Any]:
    dumped = _sample_payload(sample)
    dumped.pop("reward")
    return dumped


def run_grade(paths: RunnerPaths) -> int:
    """The ``grade`` command; writes ``reward.json`` only when the grader set a reward."""
    secret: str | None = None
    phase = "setup"
    try:
        manifest = _read_manifest(paths.manifest)
        rollout = _read_input(paths.grader_input)
        secret = rollout.api_key
        if not manifest.grader:
            raise SetupError(f"bundle manifest {paths.manifest} names no grader")
        grader_cls = _resolve(manifest.grader, "grader", Grader, paths.manifest)
        config = None
        if manifest.grader_config:
            config = _resolve(manifest.grader_config, "grader_config", GraderConfig, paths.manifest)
        sample = _load_agent_sample(paths.agent_sample, rollout.label)
        before = _comparable(sample)
        context = GraderContext(
            label=rollout.label,
            sample=sample,
            metadata=rollout.metadata,
            artifacts_dir=_artifacts_dir(paths.artifacts_dir),
        )
        phase = "grader"
        grader = grader_cls(copy.deepcopy(config))
        asyncio.run(grader.grade(context))
        graded = context.sample
        if graded is None:
            raise ValueError("the grader left no sample (GraderContext.sample is None)")
        if graded.reward is None and not graded.remove_sample:
            raise ValueError(
                "the grader set no reward: call ctx.set_reward(<float>) "
                "(or set ctx.sample.remove_sample = True to drop the sample)"
            )
        if _comparable(graded) != before:
            _write_json(paths.verifier_sample, _sample_payload(graded))
        reward = 0.0 if graded.reward is None else float(graded.reward)
        _write_json(paths.reward, {"reward": reward})
    except (Exception, KeyboardInterrupt, _Terminated) as exc:
        payload = _error_payload(exc, phase, secret)
        with contextlib.suppress(OSError):  # stderr below still carries it
            _write_json(paths.grader_error, payload)
        print(f"harbor-exec runner: grading failed: {payload['error']['message']}", file=sys.stderr)
        print(payload["error"]["traceback"], file=sys.stderr)
        return EXIT_SETUP if phase == "setup" else EXIT_FAILED
    print(f"harbor-exec runner: reward {reward} written to {paths.reward}")
    return EXIT_OK


# --------------------------------------------------------------------------- entry point


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m harbor_exec.container.runner",
        description="Run a bundled workflow (agent) or grader (grade) inside a task container.",
    )
    parser.add_argument("command", choices=("agent", "grade", "forward"))
    parser.add_argument(
        "--socket",
        default=RELAY_SOCKET,
        help=f"forward: the relay's unix socket (default {RELAY_SOCKET})",
    )
    parser.add_argument(
        "--sample-to-stdout",
        action="store_true",
        help="agent: hand the sample to the host as a frame on stdout, written last; "
        "everything else the runner and the workflow print goes to stderr",
    )
    parser.add_argument(
        "--manifest",
        type=Path,
        default=Path(os.environ.get(MANIFEST_ENV) or DEFAULT_MANIFEST),
        help=f"bundle manifest (env {MANIFEST_ENV}; default {DEFAULT_MANIFEST})",
    )
    parser.add_argument(
        "--code-dir",
        type=Path,
        action="append",
        default=[],
        help="a directory of the bundle's code to import from, after the standard library "
        "and the runtime's site-packages (repeatable); how python -I finds the user's code",
    )
    parser.add_argument(
        "--logs-dir",
        type=Path,
        default=Path(os.environ.get(LOGS_DIR_ENV) or "/logs"),
        help=f"Harbor's logs dir (env {LOGS_DIR_ENV}; default /logs)",
    )
    parser.add_argument(
        "--tests-dir",
        type=Path,
        default=Path(os.environ.get(TESTS_DIR_ENV) or "/tests"),
        help=f"Harbor's tests dir (env {TESTS_DIR_ENV}; default /tests)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "forward":
        return run_forward(args.socket)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # The container is offline: litellm (which the SDK's integrations use) would try to
    # fetch its model cost map when imported. Set for the user's code and its children.
    for name, value in LITELLM_OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
    paths = RunnerPaths(manifest=args.manifest, logs_dir=args.logs_dir, tests_dir=args.tests_dir)
    # Appended, never first: nothing in a code dir shadows the standard library or the
    # runner's own modules in the read-only runtime and dependency environment.
    sys.path.extend(str(path.absolute()) for path in args.code_dir)
    # Turn the host's SIGTERM into an exception so the error file still gets written.
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.command == "grade":
        return run_grade(paths)
    frame_fd = None
    if args.sample_to_stdout:
        # Keep the exec's stdout for the frame alone (a private, non-inheritable dup):
        # what the workflow and its children print goes where stderr goes.
        sys.stdout.flush()
        frame_fd = os.dup(1)
        os.dup2(2, 1)
    return run_agent(paths, frame_fd)


if __name__ == "__main__":
    sys.exit(main())
