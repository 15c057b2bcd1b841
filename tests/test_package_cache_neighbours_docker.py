"""Two tasks through one package cache on the real engine, one of them hostile: a
neighbour can neither starve another task's downloads nor flush what it stored.

The upstream is a local HTTPS file host on 127.0.0.1 (``tests/package_upstream.py``)
under a test name the egress proxies map to it (DNS off): nothing leaves loopback.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_exec.network.egress.plan import EgressSettings
from harbor_exec.network.packages.ca import LocalCA
from harbor_exec.network.packages.cache import PER_TRIAL_UPSTREAM
from harbor_exec.network.packages.service import PackageCacheConfig, PackageCacheService
from harbor_exec.network.packages.session import RESULT_FILE
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_TASK
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from tests.package_upstream import TEST_TLS_HOSTS, Upstream, serve_upstream, sni_context
from tests.task_factory import make_task

# engine_lane: its own cache, tasks and upstream; its one time bound is relative (victim vs control).
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

DOCKERFILE = "FROM python:3.11-slim-bookworm\n"
TOML = """
[agent]
timeout_sec = 120.0

[verifier]
timeout_sec = 120.0
"""


def _victim_test(paths: list[str]) -> str:
    """test.sh: download each file through the cache and check its digest (written
    beside it in /tests), as a task's pip or apt would."""
    return f"""
python3 - <<'PY'
import hashlib, urllib.request
for path in {paths!r}:
    name = path.rsplit("/", 1)[1]
    body = urllib.request.urlopen("https://files.test" + path, timeout=100).read()
    assert hashlib.sha256(body).hexdigest() == open(f"/tests/{{name}}.sha256").read().strip()
PY
[ $? -eq 0 ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
"""


#: The drip-feed attacker: 64 downloads at once from a server that sends a byte every
#: two seconds, each read a little and held, until the test ends its container (its
#: agent timeout bounds it otherwise).
DRIP_SOLVE = """
python3 - <<'PY'
import threading, time, urllib.request
def drip(i):
    try:
        answer = urllib.request.urlopen(
            f"https://files.test/packages/drip-{i}-1.0-py3-none-any.whl", timeout=300)
        answer.read(1)
        time.sleep(300)
    except Exception as exc:
        pass
threads = [threading.Thread(target=drip, args=(i,), daemon=True) for i in range(64)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
PY
"""

#: The burst attacker: sixteen large downloads at once against a small bound.
BURST_SOLVE = """
python3 - <<'PY'
import concurrent.futures, urllib.request
def get(i):
    url = f"https://files.test/packages/burst-{i}-1.0-py3-none-any.whl"
    return len(urllib.request.urlopen(url, timeout=100).read())
with concurrent.futures.ThreadPoolExecutor(16) as pool:
    print("got", sum(pool.map(get, range(16))), "bytes")
PY
"""


def _end_containers_of(task: str) -> None:
    """Kill a task's running containers (the attacker hangs up all at once)."""
    import docker

    client = docker.from_env()
    try:
        for found in client.api.containers(filters={"label": f"{LABEL_TASK}={task}"}):
            with contextlib.suppress(docker.errors.APIError):  # it ended on its own
                client.api.kill(found["Id"])
    finally:
        client.close()


@pytest.fixture
def https(upstream_ca: LocalCA) -> Iterator[Upstream]:
    with serve_upstream(sni_context(upstream_ca)) as upstream:
        yield upstream


def _service(tmp_path: Path, upstream_ca: LocalCA, max_bytes: int) -> PackageCacheService:
    return PackageCacheService(
        PackageCacheConfig(
            root=tmp_path / "cache",
            max_bytes=max_bytes,
            upstream_ca_bundle=upstream_ca.cert_path,
            tls_hosts=TEST_TLS_HOSTS,
        )
    )


def _victim(tmp_path: Path, https: Upstream, name: str, sizes: list[int]) -> Path:
    paths = [f"/packages/{name}-{i}-1.0-py3-none-any.whl" for i in range(len(sizes))]
    task = make_task(
        tmp_path / "tasks", name, test=_victim_test(paths), toml=TOML, dockerfile=DOCKERFILE
    )
    for path, size in zip(paths, sizes, strict=True):
        body = os.urandom(size)
        https.set(path, body)
        digest = hashlib.sha256(body).hexdigest()
        (task / "tests" / f"{path.rsplit('/', 1)[1]}.sha256").write_text(digest)
    return task


def _run(
    runtime: DockerRuntime,
    task: Path,
    tmp_path: Path,
    service: PackageCacheService,
    https: Upstream,
) -> tuple[TrialResult, dict[str, int], float]:
    """One trial through the cache: its result, its cache figures and its seconds."""
    egress = EgressSettings(overrides={"files.test": ("127.0.0.1", https.port)}, dns=False)
    started = time.monotonic()
    result = run_trial(
        runtime,
        TrialRequest(
            TrialSpec(
                task=load_task(task),
                trials_dir=tmp_path / "trials",
                policy=SandboxPolicy(egress=egress),
            ),
            package_cache=service,
        ),
    )
    seconds = time.monotonic() - started
    stats = json.loads((tmp_path / "trials" / result.trial_name / RESULT_FILE).read_text())
    return result, stats, seconds


def test_a_drip_feeding_neighbour_neither_fails_nor_slows_another_task(
    docker_runtime: DockerRuntime, tmp_path: Path, upstream_ca: LocalCA, https: Upstream
) -> None:
    for i in range(64):
        https.set(f"/packages/drip-{i}-1.0-py3-none-any.whl", b"x" * 4096, bytes_per_sec=0.5)
    service = _service(tmp_path, upstream_ca, 256 * 1024**2)
    try:
        control_task = _victim(tmp_path, https, "control", [400_000, 400_000])
        control, _, control_sec = _run(docker_runtime, control_task, tmp_path, service, https)
        assert control.reward == 1.0, control.exception_info

        attacker_task = make_task(
            tmp_path / "tasks", "attacker", solve=DRIP_SOLVE, toml=TOML, dockerfile=DOCKERFILE
        )
        attacked: list[TrialResult] = []
        attacker = threading.Thread(
            target=lambda: attacked.append(
                _run(docker_runtime, attacker_task, tmp_path, service, https)[0]
            )
        )
        attacker.start()
        try:
            drips = [f"/packages/drip-{i}-1.0-py3-none-any.whl" for i in range(64)]
            deadline = time.monotonic() + 90  # the attacker's image build and start
            while sum(https.count(p) for p in drips) < PER_TRIAL_UPSTREAM:
                assert time.monotonic() < deadline, "the attacker never started its drips"
                assert attacker.is_alive(), attacked
                time.sleep(0.2)
            # Its share of the upstream, and no more, is held while the victim runs.
            victim_task = _victim(tmp_path, https, "victim", [400_000, 400_000])
            victim, stats, victim_sec = _run(docker_runtime, victim_task, tmp_path, service, https)
            held = sum(https.count(p) for p in drips)
        finally:
            _end_containers_of("attacker")
            attacker.join(180)
        assert victim.reward == 1.0, victim.exception_info
        assert stats["upstream_errors"] == 0 and stats["misses"] == 2, stats
        # As fast as without the attacker (two cores: the attacker's container competes).
        assert victim_sec < control_sec * 1.5 + 5, (victim_sec, control_sec)
        assert held == PER_TRIAL_UPSTREAM
        # The attacker's downloads ended with it: nothing left filling, no slot or byte
        # reserved for them.
        deadline = time.monotonic() + 10
        while service.cache._fills:
            assert time.monotonic() < deadline, list(service.cache._fills)
            time.sleep(0.1)
        assert service.cache.store.in_flight == 0
    finally:
        service.close()


def test_a_burst_of_large_fills_keeps_the_bound_and_another_tasks_entries(
    docker_runtime: DockerRuntime, tmp_path: Path, upstream_ca: LocalCA, https: Upstream
) -> None:
    bound = 4 * 1024**2
    for i in range(16):
        https.set(f"/packages/burst-{i}-1.0-py3-none-any.whl", os.urandom(900_000))
    service = _service(tmp_path, upstream_ca, bound)
    store = service.cache.store
    try:
        victim_task = _victim(tmp_path, https, "victim", [200_000, 200_000, 200_000])
        first, stats, _ = _run(docker_runtime, victim_task, tmp_path, service, https)
        assert first.reward == 1.0 and stats["misses"] == 3, (first.exception_info, stats)
        stored = set(store._lru)

        peak = [0]
        watching = threading.Event()
        watching.set()

        def watch() -> None:
            while watching.is_set():
                peak[0] = max(peak[0], store.size + store.in_flight)
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        attacker_task = make_task(
            tmp_path / "tasks", "attacker", solve=BURST_SOLVE, toml=TOML, dockerfile=DOCKERFILE
        )
        try:
            attacker, _, _ = _run(docker_runtime, attacker_task, tmp_path, service, https)
        finally:
            watching.clear()
            watcher.join()
        assert (
            "got 14400000 bytes"
            in (tmp_path / "trials" / attacker.trial_name / "agent" / "oracle.txt").read_text()
        )  # every download served whole, stored or not
        assert peak[0] <= bound and store.size <= bound
        assert stored <= set(store._lru)  # the victim's entries stay

        again, stats, _ = _run(docker_runtime, victim_task, tmp_path, service, https)
        assert again.reward == 1.0
        assert stats["hits"] == 3 and stats["misses"] == 0, stats
    finally:
        service.close()
