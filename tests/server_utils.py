"""Helpers for the server tests: a real uvicorn server on 127.0.0.1 and test workflows.

Import as ``server_utils`` (pytest puts ``tests/`` on ``sys.path``); the
workflow classes are also reachable as ``"server_utils:ScriptedWorkflow"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from harbor_exec.authoring import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    ConcurrencyConfig,
    Grader,
    GraderContext,
)

PROMPT = [{"role": "user", "content": "What is 2+2?"}]
CHAT_URL = "http://127.0.0.1:9/v1/chat/completions"


class ScriptedWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    """Answers ``metadata["answer"]`` (default "4"), driven by metadata keys:
    ``sleep`` (seconds before answering), ``raise`` (message of a RuntimeError)."""

    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> AgentWorkflowOutput:
        script = ctx.metadata or {}
        if script.get("sleep"):
            await asyncio.sleep(float(script["sleep"]))
        if script.get("raise"):
            raise RuntimeError(str(script["raise"]))
        answer = str(script.get("answer", "4"))
        return AgentWorkflowOutput(
            messages=[*ctx.prompt, {"role": "assistant", "content": answer}],
            metrics={"answer_length": float(len(answer))},
        )


class ExactMatchGrader(Grader):
    """Reward 1.0 when the last message equals the label, else 0.0; ``metadata["remove"]``
    drops the sample, ``metadata["grader_sleep"]`` delays grading."""

    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        script = ctx.metadata or {}
        if script.get("grader_sleep"):
            await asyncio.sleep(float(script["grader_sleep"]))
        answer = ctx.sample.messages[-1]["content"]
        ctx.set_reward(1.0 if answer == ctx.label else 0.0)
        if script.get("remove"):
            ctx.sample.remove_sample = True


SINGLE_SLOT = AgentWorkflowConfig(name="single", concurrency=ConcurrencyConfig(max_concurrent=1))
UNLIMITED = AgentWorkflowConfig(name="unlimited", concurrency=ConcurrencyConfig(max_concurrent=None))


class ServerThread:
    """A uvicorn server for ``app`` on 127.0.0.1 (ephemeral port) in its own thread and loop."""

    def __init__(self, app: Any, *, graceful_shutdown_sec: float = 2.0) -> None:
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=graceful_shutdown_sec,
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
def serve(app: Any, *, graceful_shutdown_sec: float = 2.0) -> Iterator[str]:
    """Serve ``app`` for the duration of the block; yields its base URL."""
    server = ServerThread(app, graceful_shutdown_sec=graceful_shutdown_sec)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` (bounded in time); True once it holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
