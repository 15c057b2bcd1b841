"""Per-turn overhead of the environment adapter terminus-2 runs on (``HarborExecEnvironment``).

One terminus-2 turn costs the environment one ``tmux send-keys`` and one
``tmux capture-pane -p -S -`` (plus a ``has-session``). This runs that turn, alternating:

* against a real trial container (``debian:bookworm-slim``, no tmux of its own: the
  read-only runtime's) through the adapter;
* through Harbor 0.26's own ``DockerEnvironment`` (``docker compose exec`` per call),
  on an image it builds from the same local base, with the same tmux
  (``bench/harbor_docker.py``): the target is at most 0.5x of it;
* through the plain ``docker exec`` CLI into our container, for reference (the floor
  of any per-call CLI).

Prints the medians (and p90) in ms and the ratios. Without ``docker compose`` (v2;
``scripts/setup.sh`` installs it) Harbor's environment is skipped.

    .venv/bin/python bench/bench_native_env.py [--turns 30]
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harbor_docker import (
    compose_v2_available,
    dockerfile,
    runtime_volume,
    write_compose_overlay,
)
from harbor_exec.agents.base import AgentInfo, AgentRun, AgentSession
from harbor_exec.container.exchange import RUNTIME_TMUX
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import Task, load_task
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import Trial, TrialRequest
from tests.task_factory import make_task

TARGET = 0.5
BASE_IMAGE = "debian:bookworm-slim"
START = (
    "export TERM=xterm-256color && tmux new-session -x 160 -y 40 -d -s t 'bash --login' "
    "&& tmux set-option -g history-limit 10000000"
)
SEND = "tmux send-keys -t t -- 'echo turn' Enter"
CAPTURE = "tmux capture-pane -p -S - -t t"


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return f"median {statistics.median(values) * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms"


@dataclass
class BenchAgent:
    turns: int
    scratch: Path
    runtime: DockerRuntime
    with_harbor: bool
    adapter: list[float] = field(default_factory=list)
    cli: list[float] = field(default_factory=list)
    harbor: list[float] = field(default_factory=list)

    @property
    def info(self) -> AgentInfo:
        return AgentInfo(name="bench", version="1")

    def files(self, task: Task) -> list[ArchiveEntry]:
        return []

    def run(self, session: AgentSession, timeout_sec: float | None) -> AgentRun:
        asyncio.run(self.bench(session))
        return AgentRun(exit_code=0, timed_out=False)

    async def bench(self, session: AgentSession) -> None:
        from harbor.models.trial.paths import TrialPaths

        from harbor_exec.agents.native.environment import HarborExecEnvironment

        paths = TrialPaths(self.scratch / "trial")
        paths.mkdir()
        env = HarborExecEnvironment.of_session(session, paths)
        await env.start(force_build=False)
        started = await env.exec(START)
        assert started.return_code == 0, started.stderr
        docker = shutil.which("docker")
        assert docker is not None, "the comparison needs the docker CLI"
        harbor = await self.start_harbor() if self.with_harbor else None
        try:
            await self.turns_of(env, harbor, docker, session.container_id)
        finally:
            if harbor is not None:
                await harbor.stop(delete=True)

    async def start_harbor(self) -> Any:
        """Harbor's ``DockerEnvironment`` built (once, cached after) and started."""
        from harbor.environments.docker.docker import DockerEnvironment
        from harbor.models.task.config import EnvironmentConfig
        from harbor.models.trial.paths import TrialPaths

        environment_dir = self.scratch / "harbor-task" / "environment"
        environment_dir.mkdir(parents=True)
        (environment_dir / "Dockerfile").write_text(dockerfile(BASE_IMAGE))
        overlay = self.scratch / "harbor-overlay.yaml"
        write_compose_overlay(overlay, runtime_volume(self.runtime))
        paths = TrialPaths(self.scratch / "harbor-trial")
        paths.mkdir()
        harbor = DockerEnvironment(
            environment_dir=environment_dir,
            environment_name="hx-bench-native-env",
            session_id=f"hx-bench-native-env__{os.getpid()}",
            trial_paths=paths,
            task_env_config=EnvironmentConfig(),
            extra_docker_compose=[overlay],
        )
        await harbor.start(force_build=False)
        # The overlay's ``network_mode: none``: loopback only, nothing leaves the machine.
        interfaces = await harbor.exec("ls /sys/class/net")
        assert interfaces.stdout.split() == ["lo"], interfaces.stdout
        started = await harbor.exec(START)
        assert started.return_code == 0, started.stdout
        return harbor

    async def turns_of(self, env: Any, harbor: Any, docker: str, cid: str) -> None:
        cli_tmux = f'tmux() {{ {RUNTIME_TMUX} "$@"; }}; '
        for _ in range(self.turns):  # alternating, so drift hits all alike
            begin = time.perf_counter()
            await env.exec(SEND)
            await env.exec(CAPTURE)
            self.adapter.append(time.perf_counter() - begin)
            if harbor is not None:
                begin = time.perf_counter()
                sent = await harbor.exec(SEND)
                captured = await harbor.exec(CAPTURE)
                self.harbor.append(time.perf_counter() - begin)
                assert sent.return_code == 0 and captured.return_code == 0, captured.stdout
            begin = time.perf_counter()
            for command in (SEND, CAPTURE):
                process = await asyncio.create_subprocess_exec(
                    *(docker, "exec", "-w", "/app", cid, "bash", "-c", cli_tmux + command),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
                await process.communicate()
                assert process.returncode == 0
            self.cli.append(time.perf_counter() - begin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    args = parser.parse_args()
    runtime = DockerRuntime()
    with_harbor = compose_v2_available()
    with tempfile.TemporaryDirectory(prefix="hx-bench-native-") as scratch:
        root = Path(scratch)
        task = make_task(
            root / "tasks", "bench-native", dockerfile=f"FROM {BASE_IMAGE}\nWORKDIR /app\n"
        )
        agent = BenchAgent(args.turns, root / "scratch", runtime, with_harbor)
        request = TrialRequest(
            TrialSpec(task=load_task(task), trials_dir=root / "trials"), agent=agent
        )
        result = Trial(runtime, request).run()
        assert result.exception_info is None, result.exception_info
    runtime.close()
    adapter = statistics.median(agent.adapter)
    print(f"turns: {args.turns} (send-keys + capture-pane each)")
    print(f"adapter turn: {summary(agent.adapter)}")
    if agent.harbor:
        print(f"Harbor DockerEnvironment turn (docker compose exec): {summary(agent.harbor)}")
    print(f"docker exec CLI turn (reference): {summary(agent.cli)}")
    print(f"ratio adapter / docker exec CLI: {adapter / statistics.median(agent.cli):.2f}x")
    if not agent.harbor:
        print("Harbor's DockerEnvironment skipped: `docker compose version` fails")
        return
    ratio = adapter / statistics.median(agent.harbor)
    verdict = "ok" if ratio <= TARGET else "over target"
    print(
        f"ratio adapter / Harbor's DockerEnvironment: {ratio:.2f}x (target <= {TARGET}x): {verdict}"
    )


if __name__ == "__main__":
    main()
