"""A terminus-2 rollout of a trivial task end to end: ``harbor-exec run`` against
Harbor's own ``harbor run -a terminus-2``, the same scripted model for both.

The task asks for ``42`` in ``/app/answer.txt``; the model (``tests/scripted_chat.py``
on 127.0.0.1) answers with the keystrokes that write it, then ``task_complete`` twice.
Both CLIs run Harbor's terminus-2 class on the host, dialling the fake directly
(Harbor) or through the trial's relay (harbor-exec), with the same agent kwargs
(``max_turns=6``, no summarization, no asciinema recording, the whole chat kept: what
harbor-exec forces). Harbor's container gets the same tmux (the runtime volume, linked
onto ``PATH``) and no network (``bench/harbor_docker.py``), so neither installs
anything. Images are warm for both: one run of each first, not counted, and Harbor
keeps its built image (``--no-delete``; its containers are removed either way).

Each repetition is the wall time of the whole CLI process (start to exit, a fresh
job), alternating the two; every run must give reward 1.0 after three model calls.
Prints the medians and the ratio (target: at most 0.5x).

    .venv/bin/python bench/bench_terminus_e2e.py [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench.harbor_docker import (
    compose_v2_available,
    dockerfile,
    print_ratio,
    remove_harbor_images,
    runtime_volume,
    write_compose_overlay,
)
from harbor_exec.agents.native.config import LITELLM_OFFLINE_ENV
from harbor_exec.sandbox.docker import DockerRuntime
from tests.fake_chat import ScriptedChat, terminus_reply
from tests.task_factory import make_task

TARGET = 0.5
BASE_IMAGE = "debian:bookworm-slim"
MODEL = "openai/scripted"
KEY_ENV = "HX_BENCH_KEY"
INSTRUCTION = "Write the number 42 into /app/answer.txt.\n"
TEST_SH = (
    'if [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]; then echo 1 > /logs/verifier/reward.txt; '
    "else echo 0 > /logs/verifier/reward.txt; fi\n"
)
TOML = "[agent]\ntimeout_sec = 60.0\n[verifier]\ntimeout_sec = 30.0\n"
SCRIPT = [
    terminus_reply(keystrokes=["echo 42 > /app/answer.txt\n"]),
    terminus_reply(task_complete=True),
    terminus_reply(task_complete=True),
]
#: What harbor-exec sets for terminus-2 (``FORCED_KWARGS``, the driver's default), for Harbor.
HARBOR_KWARGS = (
    "max_turns=6",
    "enable_summarize=false",
    "record_terminal_session=false",
    "store_all_messages=true",
)
RUN_TIMEOUT_SEC = 300
#: The task's name, which Harbor's per-trial image tags start with (removed at the end).
TASK = "hx-bench-e2e-answer"


def harbor_exec_command(dataset: Path, jobs: Path, job: str, api_base: str) -> list[str]:
    command = [sys.executable, "-m", "harbor_exec.cli", "run", str(dataset)]
    command += ["--agent", "terminus-2", "--model-name", MODEL, "--api-base", api_base]
    command += ["--api-key-env", KEY_ENV, "--agent-kwarg", "max_turns=6", "-n", "1"]
    return [*command, "--jobs-dir", str(jobs), "--job-name", job]


def harbor_command(dataset: Path, jobs: Path, job: str, api_base: str, overlay: Path) -> list[str]:
    harbor = shutil.which("harbor", path=str(Path(sys.executable).parent)) or "harbor"
    command = [harbor, "run", "-p", str(dataset), "-a", "terminus-2", "-m", MODEL]
    command += ["--base-url", api_base]
    for kwarg in HARBOR_KWARGS:
        command += ["--ak", kwarg]
    command += ["--extra-docker-compose", str(overlay), "--no-delete", "-n", "1", "-y", "-q"]
    return [*command, "-o", str(jobs), "--job-name", job]


def timed_run(command_for: Callable[[str], list[str]], jobs: Path, job: str) -> float:
    """The wall time of ``command_for(api_base)`` against a fresh scripted model, which
    must have written ``job`` whose one trial got reward 1.0 after three model calls."""
    env = {**os.environ, **LITELLM_OFFLINE_ENV, KEY_ENV: "sk-bench", "OPENAI_API_KEY": "sk-bench"}
    with ScriptedChat(SCRIPT, per_conversation=True) as chat:
        command = command_for(chat.base_url)
        begin = time.perf_counter()
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_SEC
        )
        seconds = time.perf_counter() - begin
        calls = len(chat.requests)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert calls == len(SCRIPT), f"{calls} model calls: {done.stdout[-2000:]}"
    rewards = [
        json.loads(result.read_text())["verifier_result"]["rewards"]
        for result in (jobs / job).glob("*/result.json")
    ]
    assert rewards == [{"reward": 1.0}], rewards
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not compose_v2_available():
        raise SystemExit("Harbor's docker environment needs `docker compose` (v2): run setup.sh")
    ours: list[float] = []
    theirs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="hx-bench-e2e-") as scratch:
        root = Path(scratch)
        dataset = root / "answers"
        make_task(
            dataset,
            TASK,
            test=TEST_SH,
            instruction=INSTRUCTION,
            toml=TOML,
            dockerfile=dockerfile(BASE_IMAGE),
        )
        jobs = root / "jobs"
        overlay = root / "overlay.yaml"
        try:
            for rep in range(args.reps + 1):  # rep 0 warms both (images, caches): not counted
                ours_job, harbor_job = f"hx-{rep}", f"harbor-{rep}"
                ours_s = timed_run(
                    partial(harbor_exec_command, dataset, jobs, ours_job), jobs, ours_job
                )
                # harbor-exec's first trial made the runtime volume Harbor's container mounts.
                write_compose_overlay(overlay, runtime_volume(DockerRuntime()))
                harbor_run = partial(harbor_command, dataset, jobs, harbor_job, overlay=overlay)
                theirs_s = timed_run(harbor_run, jobs, harbor_job)
                print(
                    f"rep {rep}{' (warm-up)' if rep == 0 else ''}: harbor-exec {ours_s:.1f} s, "
                    f"harbor {theirs_s:.1f} s",
                    flush=True,
                )
                if rep > 0:
                    ours.append(ours_s)
                    theirs.append(theirs_s)
        finally:
            remove_harbor_images(TASK)
    print_ratio("harbor-exec run", ours, theirs, TARGET)


if __name__ == "__main__":
    main()
