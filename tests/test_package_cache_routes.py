"""The package cache's other build and trial paths, on the fake runtime: a compose
task's service images, the server's ``POST /prewarm`` (a real HTTP server on
loopback), and the Ray node side (its own service made from the config that came
with the work, handed to its trials and builds). The real engine:
tests/test_build_cache_docker.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.executors.local import LocalExecutor
from harbor_exec.executors.ray.driver import RayExecutor
from harbor_exec.executors.ray.node import NodeAgent, NodeCall, node_package_cache_config
from harbor_exec.executors.ray.sealing import seal
from harbor_exec.executors.ray.transfer import tar_dir
from harbor_exec.executors.spec import TrialSecrets
from harbor_exec.network.packages.build_gateway import KIND, build_proxy_args
from harbor_exec.network.packages.build_route import build_cache
from harbor_exec.network.packages.service import PackageCacheConfig, PackageCacheService
from harbor_exec.network.packages.session import RESULT_FILE
from harbor_exec.network.packages.trust import trust_env
from harbor_exec.sandbox.runtime import LABEL_KIND
from harbor_exec.server.app import create_rollout_server
from harbor_exec.tasks.task import Task, load_task
from harbor_exec.trial import compose
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest, ensure_task_image, image_tag_for
from tests.fake_runtime import FakeRuntime
from tests.server_utils import serve
from tests.task_factory import make_task

OWN_PROXY = "http://proxy.example:8080"


#: What a build through the cache gets: the proxy and the CA variables (ARGs).
CACHED_BUILD_ARGS = {**build_proxy_args(), **trust_env()}


def gateway_network(runtime: FakeRuntime) -> str:
    """The RUN network of a cached build: the one build gateway's namespace."""
    [gateway_id] = [
        cid for cid, c in runtime.gateways.items() if c.spec.labels.get(LABEL_KIND) == KIND
    ]
    return f"container:{gateway_id}"


# --------------------------------------------------------------------------- compose


def compose_task(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    toml: str = "",
    db_args: dict[str, str] | None = None,
) -> Task:
    """main (built) plus a built ``db`` service with build args of its own (one of
    them ``HTTP_PROXY``; ``db_args`` added) and a prebuilt ``cache`` service."""
    root = make_task(tmp_path, "compose-cached", toml=toml or "[agent]\ntimeout_sec = 30.0\n")
    env = root / "environment"
    (env / "db").mkdir()
    (env / "db" / "Dockerfile").write_text("FROM debian:bookworm-slim\nRUN apt-get update\n")
    (env / "docker-compose.yaml").write_text("services:\n  db:\n    build: ./db\n")
    task = load_task(root)
    env = task.environment_dir.resolve()
    raw = {
        "services": {
            "main": {"build": {"context": str(env), "dockerfile": "Dockerfile"}},
            "db": {
                "build": {
                    "context": str(env / "db"),
                    "dockerfile": "Dockerfile",
                    "args": {
                        "HTTP_PROXY": OWN_PROXY,
                        "FLAVOUR": "mint",
                        "UNSET": None,
                        **(db_args or {}),
                    },
                },
                "command": ["sleep", "infinity"],
            },
            "cache": {"image": "redis:7"},
        }
    }
    monkeypatch.setattr(compose, "_config", lambda *args: raw)
    return task


@contextlib.contextmanager
def cache_service(tmp_path: Path) -> Iterator[PackageCacheService]:
    """A package cache under ``tmp_path``, closed (its gateway removed) at the end."""
    service = PackageCacheService(PackageCacheConfig(root=tmp_path / "cache"))
    try:
        yield service
    finally:
        service.close()


def service_tag(runtime: FakeRuntime) -> str:
    [tag] = [t for t in runtime.builds if t.startswith("harbor-exec/service:")]
    return tag


def test_compose_service_images_build_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = compose_task(tmp_path, monkeypatch)
    runtime = FakeRuntime()
    with cache_service(tmp_path) as service:
        image, built = ensure_task_image(runtime, task, build_cache(service))
        assert built and image == compose.main_image_tag(task)
        network = gateway_network(runtime)
        db = service_tag(runtime)
        assert runtime.build_args[image] == CACHED_BUILD_ARGS
        # The service's own args are kept; its explicit HTTP_PROXY wins over ours.
        assert runtime.build_args[db] == {
            **CACHED_BUILD_ARGS,
            "HTTP_PROXY": OWN_PROXY,
            "FLAVOUR": "mint",
        }
        assert runtime.build_networks[image] == runtime.build_networks[db] == network
        assert "redis:7" in runtime.images and "redis:7" not in runtime.build_args


def test_a_compose_service_whose_own_args_set_a_ca_variable_builds_outside_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build argument of the service's own naming a CA bundle would win over the
    cache's (its tools would reject the cache's certificates): that service builds as
    without the cache, its own arguments as given; main still builds through it."""
    task = compose_task(tmp_path, monkeypatch, db_args={"SSL_CERT_FILE": "/etc/ssl/db.pem"})
    runtime = FakeRuntime()
    with cache_service(tmp_path) as service:
        image, built = ensure_task_image(runtime, task, build_cache(service))
        assert built
        db = service_tag(runtime)
        assert runtime.build_args[image] == CACHED_BUILD_ARGS
        assert runtime.build_args[db] == {
            "HTTP_PROXY": OWN_PROXY,
            "FLAVOUR": "mint",
            "SSL_CERT_FILE": "/etc/ssl/db.pem",
        }
        assert runtime.build_networks[db] is None and runtime.build_context_files[db] == {}


def test_compose_service_images_without_the_cache_keep_their_own_args(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for policy_cache, toml in (
        (False, ""),
        (True, "[metadata]\nharbor_exec_package_cache = false\n"),
    ):
        task = compose_task(tmp_path / str(policy_cache), monkeypatch, toml)
        runtime = FakeRuntime()
        with cache_service(tmp_path) as service:
            ensure_task_image(runtime, task, build_cache(service if policy_cache else None))
            db = service_tag(runtime)
            assert runtime.build_args[db] == {"HTTP_PROXY": OWN_PROXY, "FLAVOUR": "mint"}
            assert runtime.build_args[compose.main_image_tag(task)] == {}
            assert set(runtime.build_networks.values()) == {None}
            assert runtime.gateways == {}  # no gateway started


def test_a_compose_trial_builds_its_services_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = compose_task(tmp_path, monkeypatch)
    runtime = FakeRuntime()
    with cache_service(tmp_path) as service:
        spec = TrialSpec(task=task, trials_dir=tmp_path / "trials")
        request = TrialRequest(spec, package_cache=service)
        result = run_trial(runtime, request)
        assert result.exception_info is None, result.exception_info
        db = service_tag(runtime)
        assert runtime.build_args[db]["FLAVOUR"] == "mint"
        assert runtime.build_args[db]["https_proxy"] == build_proxy_args()["https_proxy"]
        assert runtime.build_networks[db] == gateway_network(runtime)


# --------------------------------------------------------------------------- POST /prewarm


def test_the_servers_prewarm_builds_through_the_cache(tmp_path: Path) -> None:
    task_dir = make_task(tmp_path / "tasks", "prewarmed")
    tag = image_tag_for(load_task(task_dir))
    runtime = FakeRuntime()
    backend = HarborBackend(
        tasks_dir=task_dir,
        executor=LocalExecutor(runtime),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        package_cache=PackageCacheConfig(root=tmp_path / "cache"),
    )
    app = create_rollout_server(
        backend=backend,
        artifact_root=tmp_path / "server-artifacts",
        shutdown_drain_sec=0.5,
        shutdown_cleanup_sec=5.0,
    )

    async def prewarm(url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.post(f"{url}/prewarm", json={"all": True})
            assert response.status_code == 200, response.text
            return dict(response.json())

    with serve(app) as url:
        summary = asyncio.run(prewarm(url))
        assert summary["built"] == 1 and summary["failed"] == 0, summary
        assert runtime.build_args[tag] == CACHED_BUILD_ARGS
        network = gateway_network(runtime)
        assert runtime.build_networks[tag] == network
        [gateway] = [c for c in runtime.gateways.values() if c.spec.labels[LABEL_KIND] == KIND]
        assert not gateway.removed
    # The server's shutdown closed the cache, and with it the gateway.
    assert gateway.removed and backend.package_cache is None


# --------------------------------------------------------------------------- Ray nodes


def node_agent(tmp_path: Path, runtime: FakeRuntime) -> NodeAgent:
    """A ``NodeAgent`` as Ray would hold it, on the fake runtime."""
    agent = NodeAgent.__new__(NodeAgent)
    agent._setup("a" * 32, "w0", tmp_path / "node", LocalExecutor(runtime))
    return agent


def blob(data: bytes) -> list[Any]:
    """An ``[ObjectRef]`` stand-in: awaiting it gives the bytes."""

    async def get() -> bytes:
        return data

    return [asyncio.ensure_future(get())]


def test_a_ray_node_makes_its_own_cache_for_its_prewarm_and_trials(tmp_path: Path) -> None:
    task = load_task(make_task(tmp_path / "tasks", "on-ray", toml="[agent]\ntimeout_sec = 30\n"))
    tag = image_tag_for(task)
    runtime = FakeRuntime()
    agent = node_agent(tmp_path, runtime)
    config = PackageCacheConfig(root=tmp_path / "cache")
    # What the driver sends: picklable, the plain policy and the cache's settings (a
    # service never rides in a policy).
    driver = RayExecutor("127.0.0.1:1", package_cache=config)
    policy, sent = driver._for_nodes(SandboxPolicy())
    assert policy == SandboxPolicy() and sent == config
    assert driver._for_nodes(None) == (SandboxPolicy(), config)
    spec = TrialSpec(task=task, trials_dir=tmp_path / "trials", policy=policy)

    async def scenario() -> tuple[Any, Any]:
        task_blob = blob(tar_dir(task.root))
        built = await agent.prewarm(
            task, task_blob, None, [], policy, pickle.loads(pickle.dumps(sent))
        )
        call = NodeCall(
            spec=spec,
            task_blob=task_blob,
            sealed=seal(agent.public_key(), pickle.dumps(TrialSecrets())),
            package_cache=sent,
        )
        pickle.dumps(replace(call, task_blob=[]))  # crosses the wire (refs aside) as is
        runs = [item async for item in agent.run(call)]
        service = agent.package_cache.service
        await agent.close()
        return built, (runs[-1], service)

    try:
        built, (run, service) = asyncio.run(scenario())
    finally:
        agent.package_cache.close()
    assert built.built == 1
    # The build went through the node's service: its gateway's namespace, our args.
    assert runtime.build_args[tag] == CACHED_BUILD_ARGS
    assert str(runtime.build_networks[tag]).startswith("container:")
    # One service per node process, under the node's own directory, closed with it.
    assert isinstance(service, PackageCacheService)
    assert service.config == node_package_cache_config(config, "w0")
    assert service.config.root == tmp_path / "cache" / "ray-nodes" / "w0"
    assert (service.config.root / "package-cache-ca").is_dir()
    assert agent.package_cache.service is None
    assert all(c.removed for c in runtime.gateways.values())
    # The trial on the node used it: its record came back in the trial's files.
    assert run.result.exception_info is None, run.result.exception_info
    names = _tar_names(run.archive)
    assert RESULT_FILE in names, names
    stats = json.loads(_tar_member(run.archive, RESULT_FILE))
    assert "requests" in stats and "misses" in stats


def _tar_names(data: bytes) -> list[str]:
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return [m.name.removeprefix("./") for m in archive.getmembers()]


def _tar_member(data: bytes, name: str) -> bytes:
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        for member in archive.getmembers():
            if member.name.removeprefix("./") == name:
                extracted = archive.extractfile(member)
                assert extracted is not None
                return extracted.read()
    raise AssertionError(f"{name} not in the archive")


# --------------------------------------------------------------------------- a trial's start


def test_a_trial_runs_on_when_the_cache_cannot_mark_its_start_or_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Revalidating ahead is a speed-up: a cache that cannot mark a trial's start or
    remember what it asked (its loop gone, say) costs the trial nothing else."""
    from harbor_exec.network.packages.service import TrialCache

    def broken(self: TrialCache, *args: object) -> None:
        raise RuntimeError("the cache's loop is gone")

    monkeypatch.setattr(TrialCache, "begin", broken)
    monkeypatch.setattr(TrialCache, "finish", broken)
    task = load_task(make_task(tmp_path / "tasks", "plain"))
    runtime = FakeRuntime()
    with cache_service(tmp_path) as service:
        request = TrialRequest(
            TrialSpec(task=task, trials_dir=tmp_path / "trials"), package_cache=service
        )
        result = run_trial(runtime, request)
        assert result.exception_info is None, result.exception_info
        assert result.reward == 1.0
        trial_dir = tmp_path / "trials" / result.trial_name
        assert json.loads((trial_dir / RESULT_FILE).read_text())["requests"] == 0
