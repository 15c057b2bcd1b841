"""Harbor's ``BaseEnvironment`` over a real trial container (``HarborExecEnvironment``):
Harbor's exec semantics (bash, the task workdir or ``cwd``, the merged environment, the
user, a timeout that fails the call and kills nothing else), files in and out through
the archive API, and tmux from the read-only runtime in an image without one."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before litellm is imported
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.agents.base import AgentInfo, AgentRun, AgentSession
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import Task, load_task
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import Trial, TrialRequest
from tests.task_factory import make_task

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

COUNT_SLEEPERS = (
    "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done "
    "| grep -c '^sleep 300'"
)


@dataclass
class ProbeAgent:
    """Runs ``probe`` against a ``HarborExecEnvironment`` of the trial's container."""

    scratch: Path
    seen: dict[str, Any] = field(default_factory=dict)

    @property
    def info(self) -> AgentInfo:
        return AgentInfo(name="probe", version="1")

    def files(self, task: Task) -> list[ArchiveEntry]:
        return []

    def run(self, session: AgentSession, timeout_sec: float | None) -> AgentRun:
        asyncio.run(self.probe(session))
        return AgentRun(exit_code=0, timed_out=False)

    async def probe(self, session: AgentSession) -> None:
        from harbor.models.trial.paths import TrialPaths

        from harbor_exec.agents.native.environment import HarborExecEnvironment

        paths = TrialPaths(self.scratch / "trial")
        paths.mkdir()
        env = HarborExecEnvironment.of_session(
            session, paths, persistent_env={"PERSISTENT": "p", "OVERRIDDEN": "persistent"}
        )
        await env.start(force_build=False)
        seen = self.seen
        seen["pwd"] = (await env.exec("pwd")).stdout
        seen["cwd"] = (await env.exec("pwd", cwd="/tmp")).stdout
        seen["shell"] = (await env.exec("echo $BASH_VERSION")).stdout
        with env.scoped_exec_env({"SCOPED": "s"}):
            seen["env"] = (
                await env.exec(
                    'echo "$PERSISTENT $OVERRIDDEN $SCOPED $PER_EXEC"',
                    env={"OVERRIDDEN": "per-exec", "PER_EXEC": "e"},
                )
            ).stdout
        seen["uid"] = (await env.exec("id -u")).stdout
        seen["nobody"] = (await env.exec("id -u", user="nobody")).stdout
        seen["root"] = (await env.exec("id -u", user="root")).stdout
        seen["exit"] = (await env.exec("echo out; echo err >&2; exit 3")).model_dump()
        # tmux: the runtime's for our commands; the image has none on its PATH.
        seen["tmux"] = (await env.exec("tmux -V")).stdout
        seen["image_tmux"] = (await env.exec("type -P tmux || echo none")).stdout
        # A timeout fails the call and kills nothing else.
        await env.exec("nohup sleep 300 >/dev/null 2>&1 &")
        started = time.monotonic()
        try:
            await env.exec("sleep 30", timeout_sec=1)
        except RuntimeError as exc:
            seen["timeout"] = str(exc)
        seen["timeout_sec"] = time.monotonic() - started
        seen["sleepers"] = (await env.exec(COUNT_SLEEPERS)).stdout
        # Files in and out.
        source = self.scratch / "up"
        (source / "sub").mkdir(parents=True)
        (source / "a.txt").write_text("A")
        (source / "sub" / "b.sh").write_text("#!/bin/sh\necho B\n")
        (source / "sub" / "b.sh").chmod(0o755)
        await env.upload_file(source / "a.txt", "/tmp/in/a.txt")
        await env.upload_dir(source, "/tmp/tree")
        seen["uploaded"] = (await env.exec("cat /tmp/in/a.txt; /tmp/tree/sub/b.sh")).stdout
        await env.exec("mkdir -p /tmp/out/deep && echo C > /tmp/out/deep/c.txt")
        await env.download_file("/tmp/in/a.txt", self.scratch / "down" / "a.txt")
        await env.download_dir("/tmp/out", self.scratch / "down" / "out")
        seen["is_dir"] = await env.is_dir("/tmp/out")
        seen["is_file"] = await env.is_file("/tmp/out/deep/c.txt")
        try:
            await env.download_file("/nonexistent", self.scratch / "down" / "x")
        except FileNotFoundError:
            seen["missing"] = True


def test_the_adapter_has_harbors_exec_and_file_semantics(
    tmp_path: Path, docker_runtime: DockerRuntime
) -> None:
    task_dir = make_task(tmp_path / "tasks", "adapter")
    agent = ProbeAgent(tmp_path / "scratch")
    request = TrialRequest(
        TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"), agent=agent
    )
    result = Trial(docker_runtime, request).run()
    assert result.exception_info is None, result.exception_info
    seen = agent.seen
    assert seen["pwd"] == "/app\n"  # the task's WORKDIR
    assert seen["cwd"] == "/tmp\n"
    assert seen["shell"].strip()  # bash
    assert seen["env"] == "p per-exec s e\n"  # persistent < per-exec < scoped
    assert seen["uid"] == "0\n" and seen["root"] == "0\n" and seen["nobody"] == "65534\n"
    assert seen["exit"] == {"stdout": "out\n", "stderr": "err\n", "return_code": 3}
    assert seen["tmux"].startswith("tmux 3.")
    assert seen["image_tmux"] == "none\n"
    assert seen["timeout"] == "Command timed out after 1 seconds"
    assert seen["timeout_sec"] < 10
    assert seen["sleepers"] == "1\n"  # the background process outlived the timed-out call
    assert seen["uploaded"] == "AB\n"
    down = tmp_path / "scratch" / "down"
    assert (down / "a.txt").read_text() == "A"
    assert (down / "out" / "deep" / "c.txt").read_text() == "C\n"
    assert seen["is_dir"] is True and seen["is_file"] is True
    assert seen["missing"] is True
