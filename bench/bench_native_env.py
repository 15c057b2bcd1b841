"""Per-turn overhead of the environment adapter terminus-2 runs on (``HarborExecEnvironment``).

One terminus-2 turn costs the environment one ``tmux send-keys`` and one
``tmux capture-pane -p -S -`` (plus a ``has-session``). This runs that turn against a
real trial container (``debian:bookworm-slim``, no tmux of its own: the read-only
runtime's) through the adapter, and the same two commands through ``docker exec``
(the Docker CLI, one process per call), which is what Harbor's own docker
environment pays at least: it runs ``docker compose exec`` per call, the CLI plus
Compose's own start. Prints the medians (and p90) in ms and the ratio (target: at
most 0.5x).

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

from harbor_exec.container.exchange import RUNTIME_TMUX
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.trial.agents import AgentRun, TrialSession
from harbor_exec.trial.results import AgentInfo
from harbor_exec.trial.task import Task, load_task
from harbor_exec.trial.trial import Trial, TrialRequest
from tests.task_factory import make_task

TARGET = 0.5
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
    adapter: list[float] = field(default_factory=list)
    cli: list[float] = field(default_factory=list)

    @property
    def info(self) -> AgentInfo:
        return AgentInfo(name="bench", version="1")

    def files(self, task: Task) -> list[ArchiveEntry]:
        return []

    def run(self, session: TrialSession, timeout_sec: float | None) -> AgentRun:
        asyncio.run(self.bench(session))
        return AgentRun(exit_code=0, timed_out=False)

    async def bench(self, session: TrialSession) -> None:
        from harbor.models.trial.paths import TrialPaths

        from harbor_exec.trial.native_env import HarborExecEnvironment

        paths = TrialPaths(self.scratch / "trial")
        paths.mkdir()
        env = HarborExecEnvironment.of_session(session, paths)
        await env.start(force_build=False)
        started = await env.exec(START)
        assert started.return_code == 0, started.stderr
        docker = shutil.which("docker")
        assert docker is not None, "the comparison needs the docker CLI"
        cid = session.container_id
        cli_tmux = f'tmux() {{ {RUNTIME_TMUX} "$@"; }}; '
        for _ in range(self.turns):  # alternating, so drift hits both alike
            begin = time.perf_counter()
            await env.exec(SEND)
            await env.exec(CAPTURE)
            self.adapter.append(time.perf_counter() - begin)
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
    with tempfile.TemporaryDirectory(prefix="hx-bench-native-") as scratch:
        root = Path(scratch)
        task = make_task(root / "tasks", "bench-native")
        agent = BenchAgent(args.turns, root / "scratch")
        request = TrialRequest(task=load_task(task), trials_dir=root / "trials", agent=agent)
        result = Trial(runtime, request).run()
        assert result.exception_info is None, result.exception_info
    runtime.close()
    ratio = statistics.median(agent.adapter) / statistics.median(agent.cli)
    print(f"adapter turn (send-keys + capture-pane): {summary(agent.adapter)}")
    print(f"docker exec CLI turn (same two commands): {summary(agent.cli)}")
    verdict = "ok" if ratio <= TARGET else "over target"
    print(
        f"ratio {ratio:.2f}x (target <= {TARGET}x of the CLI; Harbor's compose exec "
        f"is slower still): {verdict}"
    )


if __name__ == "__main__":
    main()
