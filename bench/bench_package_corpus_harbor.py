"""The corpus of ``bench_package_corpus.py`` on Harbor 0.26 too: per task, Harbor's
per-trial time against harbor-exec's first (uncached) and warm trials.

    flock /tmp/docker-tests.lock .venv/bin/python bench/bench_package_corpus_harbor.py [--trials 3]

(after ``bench_package_corpus.py --prepare`` once). Both sides run the same task files
(``bench/corpus/``, materialized as ``bench_package_corpus.py`` does) with the oracle
agent against the same local upstreams (the stored real bytes on 127.0.0.1 under the
real names, ``--latency-ms`` before every answer, ``--mbps`` a connection).

harbor-exec: ``--trials`` trials of a task on one new cache: the first is uncached
(every byte from the upstream through the proxy), the later ones warm.

Harbor: Harbor's own Trial API (``Trial.create(TrialConfig)``, ``run()``) with its
docker environment (Docker Compose, ``environment.delete = false`` as
``bench_compose.py``: its images stay, its containers and network go), ``--trials``
trials of a task, each on a NEW EMPTY cache: Harbor has no cache, so each of its trials
gets what our first one gets. The one difference from the task's own files is an extra
compose file (``EnvironmentConfig.extra_docker_compose``, ``bench/harbor_docker.py``
``cache_route``): ``main`` joins the network namespace of a gateway container of ours
(network ``none``; the forwarder on its 127.0.0.1:3128 to the host proxy's unix socket)
and gets our trial containers' proxy variables and trust mount. The bench fails unless
``main``'s ``/sys/class/net`` is ``lo`` alone (checked by a hook at agent start; its
time is taken off Harbor's). Before the first trial each task's environment is built
once, untimed (BuildKit's cache, which Harbor's per-trial ``compose build`` then hits;
ours is prebuilt the same way).

Harbor's time is the wall time of ``Trial.create`` + ``run`` (setup to teardown
inclusive); its verifier phase is its result's ``verifier`` timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_package_corpus import (
    _build,
    _materialize,
    add_arguments,
    cache_service,
    corpus_of,
    ours,
    task_names,
    trial_line,
    upstreams,
)
from bench.harbor_docker import cache_route, compose_v2_available, remove_harbor_images
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import load_task

if TYPE_CHECKING:
    from harbor.models.trial.result import TrialResult as HarborResult

WARM_TAG = "hx-bench-warm"


@dataclass
class Row:
    """One task's figures (seconds)."""

    harbor: list[tuple[float, float]]  # (wall, verifier) per Harbor trial
    ours: list[tuple[float, float]]  # (trial, verifier); the first uncached

    @property
    def harbor_mean(self) -> tuple[float, float]:
        return _means(self.harbor)

    @property
    def first(self) -> tuple[float, float]:
        return self.ours[0]

    @property
    def warm(self) -> tuple[float, float]:
        return _means(self.ours[1:])


def _means(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.mean(p[0] for p in pairs), statistics.mean(p[1] for p in pairs)


def warm_build(environment_dir: Path, task: str) -> None:
    """Build the environment once as Harbor does (``docker compose build`` of Harbor's
    own build file), so Harbor's first trial finds the layers cached as its later ones
    do; the project (and so the image) starts with ``<task>__`` and goes with Harbor's
    images."""
    from harbor.environments.docker import COMPOSE_BUILD_PATH

    project = f"{task}__{WARM_TAG}"
    command = ["docker", "compose", "--project-name", project, "-f", str(COMPOSE_BUILD_PATH)]
    subprocess.run(
        [*command, "build"],
        env={**os.environ, "CONTEXT_DIR": str(environment_dir.resolve())},
        capture_output=True,
        check=True,
        timeout=600,
    )


def harbor_passed(result: HarborResult) -> bool:
    rewards = (result.verifier_result.rewards or {}) if result.verifier_result else {}
    return bool(rewards) and all(float(v) == 1.0 for v in rewards.values())


async def harbor_trial(task_dir: Path, trials_dir: Path, overlay: Path) -> tuple[float, float]:
    """One Harbor trial of ``task_dir`` (oracle, docker, ``overlay`` added): its wall
    time and verifier phase; fails unless it earned 1 with ``main`` on loopback only."""
    from harbor.models.environment_type import EnvironmentType
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
    from harbor.trial.hooks import TrialEvent, TrialHookEvent
    from harbor.trial.trial import Trial

    config = TrialConfig(
        task=TaskConfig(path=task_dir),
        trials_dir=trials_dir,
        agent=AgentConfig(name="oracle"),
        environment=EnvironmentConfig(
            type=EnvironmentType.DOCKER, delete=False, extra_docker_compose=[overlay]
        ),
    )
    interfaces: list[str] = []
    checking = 0.0
    begin = time.perf_counter()
    trial = await Trial.create(config)

    async def check_network(event: TrialHookEvent) -> None:
        nonlocal checking
        start = time.perf_counter()
        listed = await trial.agent_environment.exec("ls /sys/class/net")
        interfaces.extend((listed.stdout or "").split())
        checking += time.perf_counter() - start

    trial.add_hook(TrialEvent.AGENT_START, check_network)
    result = await trial.run()
    wall = time.perf_counter() - begin - checking
    if interfaces != ["lo"]:
        raise SystemExit(f"{task_dir.name}: Harbor's main has interfaces {interfaces}")
    if not harbor_passed(result):
        log = trials_dir / result.trial_name / "verifier" / "test-stdout.txt"
        tail = log.read_text()[-2500:] if log.exists() else ""
        raise SystemExit(
            f"{task_dir.name} on Harbor: {result.verifier_result}\n{result.exception_info}\n{tail}"
        )
    timing = result.verifier
    assert timing is not None and timing.started_at and timing.finished_at
    return wall, (timing.finished_at - timing.started_at).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(prepare=False)
    args = parser.parse_args()
    if args.trials < 2:
        raise SystemExit("--trials: at least 2 (the first uncached, the rest warm)")
    if not compose_v2_available():
        raise SystemExit("Harbor's docker environment needs `docker compose` (v2)")
    corpus = corpus_of(args)
    names = task_names(args)
    runtime = DockerRuntime()
    rows: dict[str, Row] = {}
    with tempfile.TemporaryDirectory(prefix="hx-bench-corpus-harbor-") as scratch:
        tmp = Path(scratch)
        with upstreams(corpus, tmp) as (public_ca, egress):
            try:
                for path in _materialize(tmp / "tasks", names):
                    task = load_task(path)
                    _build(runtime, task)
                    warm_build(path / "environment", path.name)
                    row = rows[path.name] = Row(harbor=[], ours=[])
                    service = cache_service(tmp / "cache" / path.name, public_ca)
                    try:
                        for index in range(args.trials):
                            _, total, verifier, stats = ours(
                                runtime, task, tmp / "trials", service, egress, corpus
                            )
                            row.ours.append((total, verifier))
                            print(trial_line(path.name, index, total, verifier, stats), flush=True)
                    finally:
                        service.close()
                    for index in range(args.trials):
                        # A new directory each time: a store survives its service.
                        root = tmp / "harbor-cache" / f"{path.name}-{index}"
                        service = cache_service(root, public_ca)
                        overlay = tmp / "overlays" / f"{path.name}-{index}.json"
                        try:
                            with cache_route(
                                runtime,
                                service,
                                overlay,
                                overrides=egress.overrides,
                                dns=egress.dns,
                            ) as (session, overlay):
                                before = len(corpus.seen)
                                wall, verifier = asyncio.run(
                                    harbor_trial(path, tmp / "harbor-trials", overlay)
                                )
                            stats = session.stats.to_dict()
                            stats["upstream_bytes_sent"] = sum(s[3] for s in corpus.seen[before:])
                        finally:
                            service.close()
                            shutil.rmtree(root, ignore_errors=True)
                        if not stats["upstream_bytes_sent"]:
                            raise SystemExit(f"{path.name} on Harbor: nothing from the upstreams")
                        row.harbor.append((wall, verifier))
                        line = trial_line(path.name, index, wall, verifier, stats)
                        print(f"Harbor {line}", flush=True)
            finally:
                runtime.remove_owned()
                for name in names:
                    remove_harbor_images(name)
    print(report(rows, args))


def report(rows: dict[str, Row], args: argparse.Namespace) -> str:
    """The table (Markdown): per task and the sums."""
    lines = [
        f"latency {args.latency_ms:g} ms a request, {args.mbps:g} MB/s a connection; "
        f"{args.trials} trials a task on each side; seconds",
        "",
        "| task | Harbor trial | Harbor verifier | ours first | ours warm | "
        "first / Harbor | warm / Harbor |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    sums = [0.0] * 6
    for name, row in rows.items():
        figures = (*row.harbor_mean, *row.first, *row.warm)
        sums = [a + b for a, b in zip(sums, figures, strict=True)]
        lines.append(_table_row(name, figures))
    lines.append(_table_row("**all (sums)**", tuple(sums)))
    lines.append("")
    lines.append("(ours first / warm: trial time, verifier phase in brackets)")
    return "\n".join(lines)


def _table_row(name: str, figures: tuple[float, ...]) -> str:
    harbor, harbor_verifier, first, first_verifier, warm, warm_verifier = figures
    return (
        f"| {name} | {harbor:.1f} | {harbor_verifier:.1f} | {first:.1f} ({first_verifier:.1f}) | "
        f"{warm:.1f} ({warm_verifier:.1f}) | {first / harbor:.2f} | {warm / harbor:.2f} |"
    )


if __name__ == "__main__":
    main()
