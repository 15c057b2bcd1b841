"""Harbor's ``BaseEnvironment`` over a trial's session (``AgentSession``), and the driver that
runs one of Harbor's agents (terminus-2, mini-swe-agent, opencode) on it, unchanged.

Imported only when a native agent runs (the ``native`` extra: harbor >= 0.26, which
needs Python >= 3.12); ``harbor_exec.agents.native.agent`` makes litellm offline first.

Exec semantics are Harbor's docker environment's: ``bash -c command`` as the user
asked (else ``default_user``, the task's agent user), in ``cwd`` or the task's
workdir, with the merged environment (persistent < per-exec < scoped). A
``timeout_sec`` is enforced inside the container by the runtime's busybox
``timeout``, which kills that command only (``ContainerRuntime.exec``'s own deadline
kills every process of the container, tmux's server included); a timed-out call
raises ``RuntimeError`` as Harbor's does. ``tmux`` in a command is the read-only
runtime's (a shell function of that one command, so the agent's own shell in the
pane is the image's bash, its ``PATH`` untouched). Files move through the engine's
archive API (``put_archive``/``get_archive``), bounded and without links on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, Protocol

from harbor.agents.factory import AgentFactory
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.agent.context import AgentContext
from harbor.models.agent.name import AgentName
from harbor.models.task.config import EnvironmentConfig as HarborEnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from harbor_exec.agents.base import TASK_SHELL, AgentRun, AgentSession
from harbor_exec.agents.native.config import FORCED_KWARGS, LITELLM_OFFLINE_ENV
from harbor_exec.agents.native.layer import AGENT_MARKER, AGENT_PACKAGES
from harbor_exec.container.exchange import (
    AGENT_BIN,
    AGENT_MOUNT,
    AGENT_SITE,
    RUNTIME_BUSYBOX,
    RUNTIME_PYTHON,
    RUNTIME_TMUX,
    ErrorDetail,
    ErrorFile,
)
from harbor_exec.container.forward import ForwarderThread
from harbor_exec.container.redaction import redact
from harbor_exec.errors import (
    AgentSetupError,
    AgentSetupTimeoutError,
    CancelledError,
    HarborExecError,
)
from harbor_exec.sandbox.archives import ArchiveEntry, build_archive, extract_archive, tree_entries
from harbor_exec.sandbox.runtime_volume import RUNTIME_SHELL
from harbor_exec.sandbox.users import ROOT_ID

#: How the runtime's busybox reports a command it killed on its deadline (SIGKILL).
_KILLED = 128 + 9
#: The runtime's tmux for the command, never the image's, never an install.
_TMUX_FUNCTION = f'tmux() {{ {RUNTIME_TMUX} "$@"; }}; '
#: How often the driver looks whether the trial cancelled the agent.
_CANCEL_POLL_SEC = 0.1


class NativeAgent(Protocol):
    """What the driver reads of the agent it runs (``harbor_exec.agents.native.agent``'s
    ``NativeAgent``, which imports this module only when it runs)."""

    @property
    def name(self) -> str: ...
    @property
    def model_name(self) -> str: ...
    @property
    def instruction(self) -> str: ...
    @property
    def kwargs(self) -> Mapping[str, Any]: ...
    @property
    def setup_timeout_sec(self) -> float | None: ...
    @property
    def token(self) -> str: ...
    @property
    def relay_socket(self) -> str | None: ...
    @property
    def relay_path(self) -> str: ...
    @property
    def relay_chat(self) -> Callable[[], Mapping[str, Any] | None] | None: ...
    @property
    def cancelled(self) -> threading.Event: ...
    @property
    def in_container(self) -> bool: ...


def _user(user: str | int | None) -> str:
    """Harbor's user (a name, a uid, None for root) as the engine's ``user``."""
    if user is None or user == "root" or user == 0:
        return ROOT_ID
    return str(user)


class HarborExecEnvironment(BaseEnvironment):  # type: ignore[misc]  # harbor is untyped
    """The trial's started container, attached (harbor-exec's ``Trial`` owns it)."""

    def __init__(
        self, session: AgentSession, programs: Mapping[str, str] | None = None, **kwargs: Any
    ) -> None:
        self._session = session
        # Each of ``programs`` (name: container path, e.g. an agent layer's launcher)
        # is a shell function of every command, like tmux: the image's PATH untouched.
        self._functions = _TMUX_FUNCTION + "".join(
            f'{name}() {{ {path} "$@"; }}; ' for name, path in (programs or {}).items()
        )
        super().__init__(**kwargs)

    @classmethod
    def of_session(
        cls,
        session: AgentSession,
        trial_paths: TrialPaths,
        programs: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> HarborExecEnvironment:
        """The environment of ``session``'s container, commands as its agent user;
        ``programs`` as in the constructor; ``kwargs`` are more of
        ``BaseEnvironment``'s (``persistent_env``, ...)."""
        environment = cls(
            session,
            programs,
            environment_dir=session.task.environment_dir,
            environment_name=session.task.name,
            session_id=f"{session.container_id[:12]}__env",
            trial_paths=trial_paths,
            task_env_config=HarborEnvironmentConfig(workdir=session.workdir),
            **kwargs,
        )
        environment.default_user = session.agent_user
        return environment

    @staticmethod
    def type() -> str:
        return "harbor-exec"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True, mounted=False)

    def _validate_definition(self) -> None:
        """harbor-exec's ``Trial`` built and started the container already."""

    async def start(self, force_build: bool) -> None:
        """Attach: place what the trial left pending (the agent's log directories)."""
        session = self._session
        files, session.pending_files = session.pending_files, None
        if files is not None:
            await asyncio.to_thread(session.runtime.put_archive, session.container_id, files)

    async def stop(self, delete: bool) -> None:
        """Detach; the trial removes the container."""

    # ----------------------------------------------------------------- exec

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        session = self._session
        shell: tuple[str, ...] = TASK_SHELL
        if timeout_sec is not None:
            shell = (RUNTIME_BUSYBOX, "timeout", "-s", "KILL", str(max(1, int(timeout_sec))))
            shell += TASK_SHELL
        result = await asyncio.to_thread(
            session.runtime.exec,
            session.container_id,
            [*shell, self._functions + command],
            env=self._merge_env(env),
            user=_user(self._resolve_user(user)),
            workdir=cwd or session.workdir,
        )
        if (
            timeout_sec is not None
            and result.exit_code == _KILLED
            and result.duration_sec >= max(1, int(timeout_sec)) - 0.05
        ):
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(
            stdout=result.output.decode("utf-8", errors="replace"),
            stderr=result.errors.decode("utf-8", errors="replace"),
            return_code=-1 if result.exit_code is None else result.exit_code,
        )

    # ----------------------------------------------------------------- files

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await asyncio.to_thread(self._upload_file, Path(source_path), target_path)

    def _upload_file(self, source: Path, target_path: str) -> None:
        mode = 0o755 if source.stat().st_mode & 0o111 else 0o644
        archive = build_archive([ArchiveEntry(target_path, source.read_bytes(), mode)])
        self._session.runtime.put_archive(self._session.container_id, archive)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await asyncio.to_thread(self._upload_dir, Path(source_dir), target_dir)

    def _upload_dir(self, source: Path, target_dir: str) -> None:
        archive = build_archive(tree_entries(source, target_dir.rstrip("/") or "/"))
        self._session.runtime.put_archive(self._session.container_id, archive)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await asyncio.to_thread(self._download_file, source_path, Path(target_path))

    def _download_file(self, source_path: str, target: Path) -> None:
        session = self._session
        stream = session.runtime.get_archive(session.container_id, source_path)
        if stream is None:
            raise FileNotFoundError(f"{source_path} does not exist in the container")
        with tempfile.TemporaryDirectory(prefix="hx-download-") as scratch:
            extract_archive(stream, Path(scratch), strip=0)
            found = Path(scratch) / Path(source_path).name
            if not found.is_file():
                raise FileNotFoundError(f"{source_path} is not a regular file in the container")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(found, target)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await asyncio.to_thread(self._download_dir, source_dir, Path(target_dir))

    def _download_dir(self, source_dir: str, target: Path) -> None:
        session = self._session
        stream = session.runtime.get_archive(session.container_id, source_dir)
        if stream is None:
            raise FileNotFoundError(f"{source_dir} does not exist in the container")
        extract_archive(stream, target, strip=1)


# --------------------------------------------------------------------------- the driver


def run_native_agent(
    agent: NativeAgent, session: AgentSession, timeout_sec: float | None
) -> AgentRun:
    """Set up and run Harbor's ``agent.name`` against ``session``'s container (blocks)."""
    return asyncio.run(_drive(agent, session, timeout_sec))


def _check_tmux(session: AgentSession) -> None:
    """Fail fast, naming what is missing, instead of letting Harbor try apt or curl."""
    try:
        result = session.runtime.exec(session.container_id, [RUNTIME_TMUX, "-V"], user=ROOT_ID)
        ok = result.exit_code == 0 and result.output.startswith(b"tmux ")
        detail = result.errors.decode("utf-8", errors="replace").strip()[-300:]
    except HarborExecError as exc:
        ok, detail = False, str(exc)
    if not ok:
        raise AgentSetupError(
            f"terminus-2 needs tmux from the read-only runtime ({RUNTIME_TMUX}), which is "
            f"missing or does not run in this container ({detail or 'no output'}); "
            "rebuild the runtime with `harbor-exec images bootstrap`. Nothing is installed "
            "at trial time."
        )


def _check_agent_layer(agent: NativeAgent, session: AgentSession) -> dict[str, str]:
    """The layer's programs (name: container path), or ``AgentSetupError`` naming what
    is missing: Harbor's install (curl, uv, PyPI) never runs in its place."""
    names = AGENT_PACKAGES[agent.name].program_names
    programs = {name: f"{AGENT_BIN}/{name}" for name in names}
    checks = " && ".join(
        [f"test -f {AGENT_MARKER}", *(f"test -x {path}" for path in programs.values())]
    )
    try:
        result = session.runtime.exec(session.container_id, [*RUNTIME_SHELL, checks], user=ROOT_ID)
        ok = result.exit_code == 0
    except HarborExecError:
        ok = False
    if not ok:
        raise AgentSetupError(
            f"{agent.name} needs its agent layer mounted at {AGENT_MOUNT} "
            f"({', '.join(programs.values())}), which is missing from this container: "
            f"prepare it with `harbor-exec prewarm --agent {agent.name}` (or start the "
            "backend once with access to the package index). Nothing is installed at "
            "trial time."
        )
    return programs


#: ``runner forward`` on the runtime's interpreter, from the agent layer's copy of
#: harbor-exec's container side; it prints its port and detaches.
_FORWARD = (
    f"import sys; sys.path.append({AGENT_SITE!r}); "
    "from harbor_exec.container.runner import main; sys.exit(main(['forward']))"
)


def _start_forwarder(agent: NativeAgent, session: AgentSession) -> int:
    """Start the in-container forwarder (as the agent's user; the agent can only end
    it, and the trial's kill after the phase does); its port."""
    try:
        result = session.runtime.exec(
            session.container_id,
            [RUNTIME_PYTHON, "-I", "-c", _FORWARD],
            user=session.agent_user,
            timeout_sec=60,
        )
    except HarborExecError as exc:
        raise AgentSetupError(f"{agent.name}: the relay forwarder did not start: {exc}") from None
    port = result.output.strip()
    if result.exit_code != 0 or not port.isdigit():
        detail = result.errors.decode("utf-8", errors="replace").strip()[-300:]
        raise AgentSetupError(
            f"{agent.name}: the relay forwarder did not start (exit {result.exit_code}): "
            f"{detail or 'no output'}"
        )
    return int(port)


def _agent_kwargs(agent: NativeAgent, port: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"enable_summarize": False, **agent.kwargs, **FORCED_KWARGS}
    kwargs["api_base"] = f"http://127.0.0.1:{port}{agent.relay_path}"
    kwargs["llm_kwargs"] = {**(agent.kwargs.get("llm_kwargs") or {}), "api_key": agent.token}
    return kwargs


#: opencode's provider for the relay. opencode's built-in ``openai`` provider speaks
#: the Responses API; a provider of our own on ``@ai-sdk/openai-compatible`` (compiled
#: into opencode's binary: nothing is fetched) keeps it on chat completions.
OPENCODE_PROVIDER = "harbor-exec"
#: opencode offline: no update check, no models.dev fetch, no default plugins or LSP
#: servers downloaded (each would try the internet; none is needed).
OPENCODE_OFFLINE_ENV: Mapping[str, str] = {
    "OPENCODE_DISABLE_AUTOUPDATE": "true",
    "OPENCODE_DISABLE_MODELS_FETCH": "true",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "true",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "true",
    "OPENCODE_DISABLE_SHARE": "true",
}


def in_container_env(agent: NativeAgent, port: int) -> dict[str, str]:
    """An in-container agent's environment (every command the model runs inherits it):
    the loopback forwarder as its endpoint, the relay token as its key, litellm (and
    opencode) offline."""
    url = f"http://127.0.0.1:{port}{agent.relay_path}"
    env = {
        "OPENAI_API_KEY": agent.token,
        "OPENAI_API_BASE": url,
        "OPENAI_BASE_URL": url,
        "MSWEA_COST_TRACKING": "ignore_errors",
        **LITELLM_OFFLINE_ENV,
    }
    if agent.name == "opencode":
        env.update(OPENCODE_OFFLINE_ENV)
    return env


def opencode_options(agent: NativeAgent, port: int) -> tuple[str, dict[str, Any]]:
    """opencode's model (``harbor-exec/<id>``) and options: the user's ``opencode_config``
    with the relay as the provider (the token, from the environment, as its key),
    and what keeps the chat one append-only conversation: no compaction, and no
    title call (a second conversation on the same relay)."""
    model_id = agent.model_name.partition("/")[2]
    config: dict[str, Any] = copy.deepcopy(dict(agent.kwargs.get("opencode_config") or {}))
    providers = config.setdefault("provider", {})
    providers[OPENCODE_PROVIDER] = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "harbor-exec relay",
        "options": {
            "baseURL": f"http://127.0.0.1:{port}{agent.relay_path}",
            "apiKey": "{env:OPENAI_API_KEY}",
        },
        "models": {model_id: {}},
    }
    config["compaction"] = {**(config.get("compaction") or {}), "auto": False, "prune": False}
    agents = config.setdefault("agent", {})
    agents["title"] = {**(agents.get("title") or {}), "disable": True}
    config["autoupdate"] = False
    config["share"] = "disabled"
    return f"{OPENCODE_PROVIDER}/{model_id}", {**agent.kwargs, "opencode_config": config}


async def _drive(agent: NativeAgent, session: AgentSession, timeout_sec: float | None) -> AgentRun:
    if agent.relay_socket is None:
        raise AgentSetupError(
            f"{agent.name} needs the rollout's model relay on this machine (no relay socket)"
        )
    with tempfile.TemporaryDirectory(prefix="hx-native-") as scratch:
        paths = TrialPaths(Path(scratch))
        paths.mkdir()
        if agent.in_container:
            programs = await asyncio.to_thread(_check_agent_layer, agent, session)
            port = await asyncio.to_thread(_start_forwarder, agent, session)
            extra_env = in_container_env(agent, port)
            model_name, options = agent.model_name, dict(agent.kwargs)
            if agent.name == "opencode":
                model_name, options = opencode_options(agent, port)
            kwargs = {**options, "skip_install": True}
            return await _setup_and_run(
                agent, session, timeout_sec, paths, kwargs, extra_env, programs, model_name
            )
        await asyncio.to_thread(_check_tmux, session)
        forwarder = ForwarderThread(agent.relay_socket)
        port = await asyncio.to_thread(forwarder.start)
        try:
            kwargs = _agent_kwargs(agent, port)
            return await _setup_and_run(agent, session, timeout_sec, paths, kwargs, {}, {})
        finally:
            await asyncio.to_thread(forwarder.close)


async def _setup_and_run(
    agent: NativeAgent,
    session: AgentSession,
    timeout_sec: float | None,
    paths: TrialPaths,
    kwargs: dict[str, Any],
    extra_env: dict[str, str],
    programs: Mapping[str, str],
    model_name: str | None = None,
) -> AgentRun:
    """``model_name``: the agent's own name for the model, when it is not the route."""
    try:
        harbor_agent = AgentFactory.create_agent_from_name(
            AgentName(agent.name),
            logs_dir=paths.agent_dir,
            model_name=model_name or agent.model_name,
            # Always given for an in-container agent: Harbor resolves the model's key
            # from it before this process's environment (which may hold a real key).
            extra_env=extra_env,
            **kwargs,
        )
    except Exception as exc:
        raise AgentSetupError(
            redact(f"{agent.name}: {type(exc).__name__}: {exc}", [agent.token])
        ) from None
    environment = HarborExecEnvironment.of_session(session, paths, programs)
    await environment.start(force_build=False)
    with environment.scoped_exec_env(extra_env):
        try:
            await _unless_cancelled(
                agent, asyncio.wait_for(harbor_agent.setup(environment), agent.setup_timeout_sec)
            )
        except TimeoutError:
            raise AgentSetupTimeoutError(
                f"{agent.name}'s setup took longer than {agent.setup_timeout_sec:g}s"
            ) from None
        except HarborExecError:
            raise
        except Exception as exc:
            raise AgentSetupError(
                redact(f"{agent.name} setup failed: {type(exc).__name__}: {exc}", [agent.token])
            ) from None
        context = AgentContext()
        timed_out, error = False, None
        started = time.monotonic()
        try:
            await _unless_cancelled(
                agent,
                asyncio.wait_for(
                    harbor_agent.run(agent.instruction, environment, context), timeout_sec
                ),
            )
        except TimeoutError:
            timed_out = True
        except HarborExecError:
            raise
        except Exception as exc:
            error = exc
        finally:
            if timed_out or error is not None or agent.in_container:
                # An exec the cancelled agent left in flight ends with its processes
                # (and an in-container agent's forwarder and leftovers with them).
                await asyncio.to_thread(session.runtime.stop_processes, session.container_id)
    seconds = time.monotonic() - started
    if agent.in_container:
        await _read_agent_logs(environment, harbor_agent, context)
    host_files: dict[str, bytes] = {}
    trajectory = paths.agent_dir / "trajectory.json"
    if trajectory.is_file():
        text = trajectory.read_text(encoding="utf-8", errors="replace")
        if agent.in_container:
            text = _marked_untrusted(text)
        host_files["agent/trajectory.json"] = redact(text, [agent.token]).encode()
    if agent.in_container:
        sample = _relay_sample(agent, context, error, seconds)
    else:
        sample = _sample(agent, context, error, seconds)
    return AgentRun(
        exit_code=None if timed_out else (1 if error is not None else 0),
        timed_out=timed_out,
        sample=sample,
        host_files=host_files,
        agent_result=_agent_result(context),
        error=error,
    )


async def _read_agent_logs(
    environment: HarborExecEnvironment, harbor_agent: Any, context: AgentContext
) -> None:
    """Harbor's post-run step: ``/logs/agent`` copied here (bounded, no links), the
    agent's own trajectory converted to ATIF and its counts read (all untrusted)."""
    with contextlib.suppress(Exception):
        await environment.download_dir("/logs/agent", harbor_agent.logs_dir)
    if context.is_empty():
        with contextlib.suppress(Exception):
            harbor_agent.populate_context_post_run(context)


#: How an in-container agent's ATIF trajectory says where it came from.
UNTRUSTED_NOTE = (
    "converted from the agent's own file inside the container, which the model's "
    "commands could rewrite: the sample's chat and usage are the relay's"
)


def _marked_untrusted(text: str) -> str:
    """The ATIF document as Harbor wrote it, with ``agent.extra.harbor_exec`` saying
    it is untrusted (text that is not such a document is kept as it is)."""
    try:
        document = json.loads(text)
        extra = document["agent"].setdefault("extra", None) or {}
        extra["harbor_exec"] = {"trusted": False, "note": UNTRUSTED_NOTE}
        document["agent"]["extra"] = extra
    except (ValueError, KeyError, TypeError, AttributeError):
        return text
    return json.dumps(document, indent=2)


async def _unless_cancelled(agent: NativeAgent, work: Coroutine[Any, Any, Any]) -> Any:
    """``work``'s result, or ``CancelledError`` as soon as the trial cancels the agent
    (``work`` is cancelled then: Harbor's agent stops where it awaits)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        if agent.cancelled.is_set():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise CancelledError("the trial was cancelled")
        await asyncio.wait({task}, timeout=_CANCEL_POLL_SEC)
    return task.result()


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _agent_result(context: AgentContext) -> dict[str, Any]:
    """Harbor's ``agent_result`` fields (the agent's own counts)."""
    return {
        "n_input_tokens": context.n_input_tokens,
        "n_cache_tokens": context.n_cache_tokens,
        "n_output_tokens": context.n_output_tokens,
        "cost_usd": context.cost_usd,
        "rollout_details": _plain(context.rollout_details) if context.rollout_details else None,
    }


def token_turns(
    messages: list[dict[str, Any]], rollout_details: list[dict[str, Any]] | None
) -> list[dict[str, Any]] | None:
    """Per assistant turn, its token ids and logprobs with the index of its message in
    ``messages``; None when there are none or they do not line up (a non-linear history)."""
    if not rollout_details or len(rollout_details) != 1:
        return None
    detail = rollout_details[0]
    completions = detail.get("completion_token_ids") or []
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not completions or len(completions) != len(assistant):
        return None
    prompts = detail.get("prompt_token_ids") or []
    logprobs = detail.get("logprobs") or []
    turns = []
    for turn, index in enumerate(assistant):
        turns.append(
            {
                "message_index": index,
                "prompt_token_ids": prompts[turn] if turn < len(prompts) else None,
                "completion_token_ids": completions[turn],
                "logprobs": logprobs[turn] if turn < len(logprobs) else None,
            }
        )
    return turns


def _sample(
    agent: NativeAgent, context: AgentContext, error: BaseException | None, seconds: float
) -> bytes:
    """The sample handed to the trial (``agent/sample.json``): the exact chat, or the
    runner's error form when the agent failed."""
    if error is not None:
        message = redact(f"{agent.name} failed: {type(error).__name__}: {error}", [agent.token])
        detail = ErrorDetail(type=type(error).__name__, message=message, phase="workflow")
        return ErrorFile(error=detail).model_dump_json().encode()
    metadata = context.metadata or {}
    messages = _plain(metadata.get("all_messages") or [])
    rollout_details = _plain(context.rollout_details) if context.rollout_details else None
    extra: dict[str, Any] = {
        "harbor_agent": agent.name,
        "harbor_model": agent.model_name,
        "n_episodes": metadata.get("n_episodes"),
        "agent_seconds": round(seconds, 3),
        # The agent's own counts; the sample's metrics are the relay's.
        "agent_usage": {
            "input_tokens": context.n_input_tokens,
            "cached_tokens": context.n_cache_tokens,
            "output_tokens": context.n_output_tokens,
            "cost_usd": context.cost_usd,
        },
    }
    if rollout_details is not None:
        extra["rollout_details"] = rollout_details
        turns = token_turns(messages, rollout_details)
        if turns is not None:
            extra["token_turns"] = turns
    payload = {"messages": messages, "metrics": {}, "extra_fields": extra}
    return redact(json.dumps(payload), [agent.token]).encode()


def _relay_sample(
    agent: NativeAgent, context: AgentContext, error: BaseException | None, seconds: float
) -> bytes:
    """An in-container agent's sample: the last chat call as the relay saw it (its
    messages, then the model's answer), never the agent's own files."""
    if error is not None:
        return _sample(agent, context, error, seconds)
    record = agent.relay_chat() if agent.relay_chat is not None else None
    messages: list[Any] = []
    extra: dict[str, Any] = {
        "harbor_agent": agent.name,
        "harbor_model": agent.model_name,
        "agent_seconds": round(seconds, 3),
        "chat_source": "relay",
        # What the agent's own (untrusted) trajectory counted; the metrics are the relay's.
        "agent_usage_untrusted": {
            "input_tokens": context.n_input_tokens,
            "cached_tokens": context.n_cache_tokens,
            "output_tokens": context.n_output_tokens,
            "cost_usd": context.cost_usd,
        },
    }
    if record is not None:
        messages = [*record["messages"], record["response"]]
        if record.get("tools"):
            extra["tools"] = record["tools"]
    payload = {"messages": _plain(messages), "metrics": {}, "extra_fields": _plain(extra)}
    return redact(json.dumps(payload), [agent.token]).encode()


__all__ = [
    "OPENCODE_OFFLINE_ENV",
    "OPENCODE_PROVIDER",
    "HarborExecEnvironment",
    "in_container_env",
    "opencode_options",
    "run_native_agent",
    "token_turns",
]
