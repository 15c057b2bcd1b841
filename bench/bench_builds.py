"""Cold image builds: our prewarm (BuildKit) against the legacy builder, same API.

    .venv/bin/python bench/bench_builds.py [--rounds 1] [--jobs 2] [--skip-wall]

A set of realistic task Dockerfiles (apt and pip layers, a multi-stage build, a
context copy, a Dockerfile whose ``COPY tests/`` source is missing) is prewarmed
with ``harbor_exec.jobs.prewarm.prewarm_tasks`` twice per round: once with the runtime's
BuildKit builder and once forced to the legacy builder, at the same ``--jobs``.
Every run busts the cache (a fresh nonce right after ``FROM``), so both sides build
cold. Printed: per-task times, the total ratio (target: BuildKit at most 0.8x the
legacy builder) and the failing-COPY time (target: under 2 s).

Then prewarm wall time for 20 small tasks (a shared base, a copied file and a short
``RUN`` each, cold) at ``--jobs 1`` and ``--jobs 4``. Every image made is removed.
Needs the base images (``harbor-exec images bootstrap``) and Debian/PyPI mirrors.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from harbor_exec.jobs.prewarm import PrewarmOutcome, prewarm_tasks
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.discovery import discover_tasks
from harbor_exec.tasks.task import Task
from harbor_exec.trial.trial import image_tag_for

HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
BUST = "RUN echo {nonce} > /.cache-bust\n"

DOCKERFILES: dict[str, str] = {
    # The example: apt-installs python3, pip and sqlite3.
    "apt-python-sqlite": """FROM debian:bookworm-slim
{bust}RUN apt-get update && apt-get install -y --no-install-recommends \\
        python3 python3-pip sqlite3 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
""",
    "pip-requests": """FROM python:3.11-slim-bookworm
{bust}COPY host-ca.pem /host-ca.pem
RUN python3 -m venv /opt/venv && PIP_CERT=/host-ca.pem /opt/venv/bin/pip install \
        --no-cache-dir --disable-pip-version-check requests==2.32.3 pyyaml==6.0.2
WORKDIR /app
""",
    "multi-stage": """FROM debian:bookworm-slim AS data
{bust}RUN mkdir /out && seq 1 200000 > /out/numbers.txt && sha256sum /out/numbers.txt > /out/sum
FROM python:3.11-slim-bookworm
COPY --from=data /out /data
RUN python3 -c "print(sum(int(x) for x in open('/data/numbers.txt')))" > /data/total
WORKDIR /app
""",
    "context-copy": """FROM debian:bookworm-slim
{bust}COPY src/ /app/src/
RUN find /app/src -type f | wc -l > /app/count
WORKDIR /app
""",
    # Harbor's broken-task shape: a slow layer, then a COPY whose source is not there.
    "missing-copy": """FROM debian:bookworm-slim
{bust}RUN apt-get update
COPY tests/ /tests
""",
}


def write_task(root: Path, name: str, dockerfile: str) -> None:
    task = root / name
    for sub in ("environment", "solution", "tests"):
        (task / sub).mkdir(parents=True, exist_ok=True)
    (task / "instruction.md").write_text("bench\n")
    (task / "task.toml").write_text("[environment]\nbuild_timeout_sec = 900.0\n")
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    if "host-ca.pem" in dockerfile:
        # The host's CA bundle: where PyPI is reached through a TLS-inspecting proxy,
        # pip inside the build needs it as much as pip on the host.
        shutil.copyfile(HOST_CA, task / "environment" / "host-ca.pem")
    if "COPY src/" in dockerfile:
        src = task / "environment" / "src"
        for i in range(200):
            (src / f"pkg{i % 10}").mkdir(parents=True, exist_ok=True)
            (src / f"pkg{i % 10}" / f"m{i}.py").write_text(f"VALUE = {i}\n" * 50)


def realistic_dataset(root: Path) -> list[Task]:
    nonce = uuid.uuid4().hex
    for name, text in DOCKERFILES.items():
        write_task(root, name, text.format(bust=BUST.format(nonce=nonce)))
    return discover_tasks(root).tasks


def small_dataset(root: Path, n: int) -> list[Task]:
    nonce = uuid.uuid4().hex
    for i in range(n):
        write_task(
            root,
            f"small-{i:03d}",
            f"FROM debian:bookworm-slim\n{BUST.format(nonce=nonce)}"
            f"RUN echo {i} > /id && sha256sum /id > /id.sum\nWORKDIR /app\n",
        )
    return discover_tasks(root).tasks


def run(runtime: DockerRuntime, tasks: list[Task], jobs: int) -> tuple[float, list[PrewarmOutcome]]:
    started = time.monotonic()
    outcomes = prewarm_tasks(runtime, tasks, jobs=jobs)
    return time.monotonic() - started, outcomes


def cleanup(runtime: DockerRuntime, tasks: list[Task]) -> None:
    for task in tasks:
        runtime.remove_image(image_tag_for(task))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--skip-wall", action="store_true", help="skip the 20-task wall times")
    args = parser.parse_args()
    ours = DockerRuntime()
    legacy = DockerRuntime(builder="legacy")
    print(f"engine {ours.engine_info()}; ours: {ours.builder}, against: {legacy.builder}")
    totals = {"buildkit": 0.0, "legacy": 0.0}
    for round_no in range(args.rounds):
        # Alternate who goes first, so neither side always meets a warmer mirror.
        order = [("buildkit", ours), ("legacy", legacy)]
        if round_no % 2:
            order.reverse()
        per_task: dict[str, dict[str, PrewarmOutcome]] = {}
        for name, runtime in order:
            with tempfile.TemporaryDirectory(prefix="hx-bench-builds-") as scratch:
                tasks = realistic_dataset(Path(scratch))
                try:
                    wall, outcomes = run(runtime, tasks, args.jobs)
                finally:
                    cleanup(runtime, tasks)
            totals[name] += wall
            per_task[name] = {o.task: o for o in outcomes}
            print(f"round {round_no + 1} {name}: {wall:.1f}s wall at --jobs {args.jobs}")
        print(f"  {'task':<20} {'buildkit':>10} {'legacy':>10}  ratio  status")
        for task in DOCKERFILES:
            new, old = per_task["buildkit"][task], per_task["legacy"][task]
            ratio = new.seconds / old.seconds if old.seconds else float("nan")
            print(
                f"  {task:<20} {new.seconds:>9.2f}s {old.seconds:>9.2f}s  {ratio:5.2f}  "
                f"{new.status}/{old.status}"
            )
            if task == "missing-copy":
                print(f"    buildkit reason: {new.reason[:110]}")
                print(f"    legacy reason:   {old.reason[:110]}")
    ratio = totals["buildkit"] / totals["legacy"]
    print(
        f"total over {args.rounds} round(s): buildkit {totals['buildkit']:.1f}s, legacy "
        f"{totals['legacy']:.1f}s: {ratio:.2f}x (target <= 0.8x)"
    )
    if not args.skip_wall:
        for jobs in (1, 4):
            with tempfile.TemporaryDirectory(prefix="hx-bench-wall-") as scratch:
                tasks = small_dataset(Path(scratch), 20)
                try:
                    wall, outcomes = run(ours, tasks, jobs)
                finally:
                    cleanup(ours, tasks)
            built = sum(o.status == "built" for o in outcomes)
            print(f"prewarm 20 small tasks, cold, --jobs {jobs}: {wall:.1f}s ({built} built)")
    ours.close()
    legacy.close()


if __name__ == "__main__":
    main()
