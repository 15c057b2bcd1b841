"""Helpers for the server tests: a real uvicorn server on 127.0.0.1 and test workflows.

Import as ``server_utils`` (pytest puts ``tests/`` on ``sys.path``); the
workflow classes are also reachable as ``"server_utils:ScriptedWorkflow"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from harbor_exec.authoring import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    ConcurrencyConfig,
    Grader,
    GraderContext,
    RolloutSample,
    SampleSource,
    get_rollout_context,
    set_sample_source,
)
from harbor_exec.backends.local import LocalBackend
from harbor_exec.client import RolloutClient
from harbor_exec.server import create_rollout_server

PROMPT = [{"role": "user", "content": "What is 2+2?"}]
CHAT_URL = "http://127.0.0.1:9/v1/chat/completions"


def task_rollout(url: str, metadata: dict[str, str], *, timeout_sec: float = 300) -> Any:
    """One rollout with no prompt (an oracle's: the task named by ``metadata``) at
    ``url``, through our RolloutClient; its result."""

    async def run() -> Any:
        async with httpx.AsyncClient(timeout=timeout_sec) as http:
            client = RolloutClient(url=url, http_client=http)
            return await client.run_rollout(
                initial_messages=[],
                chat_completions_url="http://127.0.0.1:9/v1",
                rollout_id=uuid.uuid4().hex,
                metadata=metadata,
            )

    return asyncio.run(run())


class Gate:
    """A point scripted workflows and graders wait at until the test opens it (metadata
    ``hold`` / ``grader_hold`` name it). The server under test runs its event loop in
    another thread: arriving and opening cross threads; a waiter stays cancellable."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._opened = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        #: Set once a rollout reached the gate.
        self.reached = threading.Event()

    async def wait(self) -> None:
        event = asyncio.Event()
        with self._lock:
            self.reached.set()
            if self._opened:
                return
            self._waiters.append((asyncio.get_running_loop(), event))
        await event.wait()

    def open(self) -> None:
        """Release every waiter, now and later."""
        with self._lock:
            self._opened = True
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)


_gates: dict[str, Gate] = {}
_gates_lock = threading.Lock()

#: A gate no test opens: a rollout held there runs until it is cancelled or times out.
NEVER = "never"


def gate(name: str | None = None) -> tuple[str, Gate]:
    """The gate ``name`` (a new, uniquely named one by default), for ``hold`` metadata."""
    name = name or f"gate-{uuid.uuid4().hex}"
    with _gates_lock:
        return name, _gates.setdefault(name, Gate())


# Rollout ids whose workflow saw its cancellation (the server runs in another thread).
CANCELLED_WORKFLOWS: set[str] = set()
_cancelled_lock = threading.Lock()


def workflow_was_cancelled(rollout_id: str) -> bool:
    with _cancelled_lock:
        return rollout_id in CANCELLED_WORKFLOWS


class ScriptedWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    """Answers ``metadata["answer"]`` (default "4"), driven by metadata keys:
    ``hold`` (a ``Gate``'s name: wait there first; ``NEVER``: until cancelled),
    ``sleep`` (seconds before answering, where a test measures time), ``raise``
    (message of a RuntimeError),
    ``echo_key`` (put the LLM key into the answer, to test redaction),
    ``block`` (seconds of time.sleep, blocking the loop),
    ``use_source`` (register a SampleSource and return None), ``report_stack``
    (answer "<event loop module> <uvicorn HTTP parser>", e.g. "uvloop httptools")."""

    async def run(
        self, ctx: AgentWorkflowContext[AgentWorkflowConfig]
    ) -> AgentWorkflowOutput | None:
        script = ctx.metadata or {}
        context = get_rollout_context()
        rollout_id = context.rollout_id if context else ""
        try:
            if script.get("hold"):
                await gate(str(script["hold"]))[1].wait()
            if script.get("sleep"):
                await asyncio.sleep(float(script["sleep"]))
        except asyncio.CancelledError:
            with _cancelled_lock:
                CANCELLED_WORKFLOWS.add(rollout_id)
            raise
        if script.get("block"):
            time.sleep(float(script["block"]))  # noqa: ASYNC251 - blocking on purpose
        if script.get("raise"):
            raise RuntimeError(str(script["raise"]))
        answer = str(script.get("answer", "4"))
        if script.get("report_stack"):
            # The serving stack: the event loop's module and uvicorn's HTTP protocol.
            loop = type(asyncio.get_running_loop()).__module__.partition(".")[0]
            httptools = "uvicorn.protocols.http.httptools_impl" in sys.modules
            answer = f"{loop} {'httptools' if httptools else 'h11'}"
        if script.get("echo_key") and context is not None:
            answer = f"{answer} (key {context.api_key})"
        messages = [*ctx.prompt, {"role": "assistant", "content": answer}]
        if script.get("use_source"):
            set_sample_source(FixedSource(messages))
            return None
        return AgentWorkflowOutput(messages=messages, metrics={"answer_length": float(len(answer))})


class FixedSource(SampleSource):
    """A sample source holding fixed messages."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages

    async def get_sample(self) -> RolloutSample:
        return RolloutSample(messages=self.messages, metrics={"from_source": 1.0})


class ExactMatchGrader(Grader):
    """Reward 1.0 when the last message equals the label, else 0.0; metadata keys:
    ``remove`` (drop the sample), ``grader_hold`` (a ``Gate``'s name),
    ``grader_sleep`` (delay), ``grader_raise``, ``no_reward`` (set nothing)."""

    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        script = ctx.metadata or {}
        if script.get("grader_hold"):
            await gate(str(script["grader_hold"]))[1].wait()
        if script.get("grader_sleep"):
            await asyncio.sleep(float(script["grader_sleep"]))
        if script.get("grader_raise"):
            raise RuntimeError(str(script["grader_raise"]))
        if script.get("no_reward"):
            return
        answer = ctx.sample.messages[-1]["content"]
        ctx.set_reward(1.0 if answer == ctx.label else 0.0)
        if script.get("remove"):
            ctx.sample.remove_sample = True


class FullBackend(LocalBackend):
    """Refuses the first ``refusals`` admissions (``has_capacity`` is False)."""

    def __init__(self, root: Path, refusals: int) -> None:
        super().__init__(workflow=ScriptedWorkflow, grader=ExactMatchGrader, artifact_root=root)
        self.refusals = refusals

    def has_capacity(self) -> bool:
        if self.refusals > 0:
            self.refusals -= 1
            return False
        return True


SINGLE_SLOT = AgentWorkflowConfig(name="single", concurrency=ConcurrencyConfig(max_concurrent=1))
UNLIMITED = AgentWorkflowConfig(
    name="unlimited", concurrency=ConcurrencyConfig(max_concurrent=None)
)


class ServerThread:
    """A uvicorn server for ``app`` on 127.0.0.1 (ephemeral port) in its own thread and loop."""

    def __init__(
        self, app: Any, *, graceful_shutdown_sec: float = 2.0, keep_alive_sec: float = 5.0
    ) -> None:
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="on",
            # uvicorn annotates both as int; it takes (and these tests use) float seconds.
            timeout_graceful_shutdown=graceful_shutdown_sec,  # type: ignore[arg-type]
            timeout_keep_alive=keep_alive_sec,  # type: ignore[arg-type]
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.url = ""

    def start(self, timeout: float = 10.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError("uvicorn did not stop in time")


@contextlib.contextmanager
def serve(
    app: Any, *, graceful_shutdown_sec: float = 2.0, keep_alive_sec: float = 5.0
) -> Iterator[str]:
    """Serve ``app`` for the duration of the block; yields its base URL."""
    server = ServerThread(
        app, graceful_shutdown_sec=graceful_shutdown_sec, keep_alive_sec=keep_alive_sec
    )
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


def local_app(
    artifact_root: Path,
    *,
    workflow_config: AgentWorkflowConfig | None = None,
    backend: Any = None,
    **server_options: Any,
) -> Any:
    """Our rollout server over ``LocalBackend(ScriptedWorkflow, ExactMatchGrader)``,
    with short shutdown waits and a 1 s ``Retry-After`` so that tests stop quickly."""
    if backend is None:
        backend = LocalBackend(
            workflow=ScriptedWorkflow,
            grader=ExactMatchGrader,
            workflow_config=workflow_config,
            artifact_root=artifact_root,
        )
    server_options.setdefault("retry_after_sec", 1)
    server_options.setdefault("shutdown_drain_sec", 0.5)
    server_options.setdefault("shutdown_cleanup_sec", 5.0)
    return create_rollout_server(backend=backend, artifact_root=artifact_root, **server_options)


def metric_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text parsed with prometheus-client's own parser: value by
    (sample name, labels); see ``metric``."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample's value in Prometheus text (None when absent)."""
    return metric_samples(text).get((name, frozenset(labels.items())))


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` (bounded in time); True once it holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def task_containers(client: Any, prefix: str, *, stopped: bool = False) -> list[Any]:
    """Our containers of tasks whose names start with ``prefix``, from the engine's list
    alone (the SDK's full list inspects each one, and one that another test removes
    meanwhile raises NotFound). Sparse: their labels are ``attrs["Labels"]``."""
    label = {"label": ["harbor-exec.managed=true", "harbor-exec.task"]}
    return [
        c
        for c in client.containers.list(all=stopped, filters=label, sparse=True)
        if (c.attrs.get("Labels") or {}).get("harbor-exec.task", "").startswith(prefix)
    ]


def runs_command(container: Any, command: str) -> bool:
    """Whether a process in ``container`` (a docker SDK container) runs ``command``:
    how an engine test knows a trial reached its agent phase, rather than sleeping."""
    try:
        listing = container.top(ps_args="-eo pid,args")
    except Exception:  # the container is gone or not running yet
        return False
    return any(command in " ".join(map(str, row)) for row in listing.get("Processes") or [])


async def wait_until_async(
    predicate: Callable[[], Awaitable[bool]], within_sec: float = 5.0, interval: float = 0.01
) -> bool:
    """Poll the coroutine function ``predicate`` for up to ``within_sec``, letting the
    event loop run in between; True once it holds."""
    deadline = time.monotonic() + within_sec
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval)
    return bool(await predicate())


def harbor_app_over(runtime: Any, tmp_path: Path, task_name: str) -> Any:
    """The rollout server over a HarborBackend whose trials run on ``runtime`` (a fake
    one), serving one task made by ``tests.task_factory.make_task``."""
    from harbor_exec.backends.harbor.backend import HarborBackend
    from harbor_exec.executors.local import LocalExecutor
    from tests.task_factory import make_task

    backend = HarborBackend(
        tasks_dir=make_task(tmp_path / "tasks", task_name),
        executor=LocalExecutor(runtime),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
    )
    return create_rollout_server(
        backend=backend,
        artifact_root=tmp_path / "server-artifacts",
        data_dir=tmp_path / "data",
        shutdown_drain_sec=0.5,
        shutdown_cleanup_sec=5.0,
    )
