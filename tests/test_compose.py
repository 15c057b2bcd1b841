"""Compose environments without an engine: the normalised model (as ``docker compose
config`` prints it) turned into our containers, on the fake runtime."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.errors import EnvironmentStartError, TaskConfigError
from harbor_exec.jobs.prewarm import prewarm_one
from harbor_exec.sandbox.runtime import LABEL_KIND, LABEL_TRIAL
from harbor_exec.tasks.task import Task, load_task
from harbor_exec.trial import compose
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import Trial, TrialRequest
from tests.fake_runtime import HOLD, FakeRuntime
from tests.task_factory import make_multi_step_task, make_task


def model(env: Path, **services: dict[str, Any]) -> dict[str, Any]:
    main = {"build": {"context": str(env), "dockerfile": "Dockerfile"}, "command": ["sleep"]}
    return {"services": {"main": main, **services}, "volumes": {"data": {"name": "x_data"}}}


def db(env: Path, **extra: Any) -> dict[str, Any]:
    return {
        "build": {"context": str(env / "db"), "dockerfile": "Dockerfile"},
        "command": ["sh", "-c", "echo $$ANSWER; exec serve"],
        "environment": {"ANSWER": "42", "UNSET": None},
        "healthcheck": {"test": ["CMD-SHELL", "true"], "interval": "1m30s", "timeout": "500ms"},
        "volumes": [
            {"type": "volume", "source": "data", "target": "/data"},
            {"type": "bind", "source": str(env / "conf"), "target": "/conf", "read_only": True},
        ],
        "networks": {"default": {"aliases": ["database"]}},
        "mem_limit": str(256 * 1024 * 1024),
        **extra,
    }


@pytest.fixture
def task(tmp_path: Path) -> Task:
    root = make_task(tmp_path, "compose-unit")
    env = root / "environment"
    (env / "db").mkdir()
    (env / "db" / "Dockerfile").write_text("FROM python:3.11-slim-bookworm\n")
    (env / "conf").mkdir()
    (env / "conf" / "app.ini").write_text("[app]\n")
    (env / "docker-compose.yaml").write_text("services:\n  db:\n    build: ./db\n")
    return load_task(root)


def patch_model(monkeypatch: pytest.MonkeyPatch, raw: dict[str, Any]) -> None:
    monkeypatch.setattr(compose, "_config", lambda *args: raw)


def project(task: Task, monkeypatch: pytest.MonkeyPatch, **services: Any) -> compose.ComposeProject:
    patch_model(monkeypatch, model(task.environment_dir.resolve(), **services))
    return compose.load_project(task, cpus=None, memory_mb=None)


def test_the_model_becomes_services_in_our_terms(
    task: Task, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = task.environment_dir.resolve()
    service = project(task, monkeypatch, db=db(env)).services["db"]
    assert service.command == ["sh", "-c", "echo $ANSWER; exec serve"]  # $$ as config prints it
    assert service.environment == {"ANSWER": "42"}
    assert service.healthcheck is not None
    assert service.healthcheck.interval_sec == 90.0 and service.healthcheck.timeout_sec == 0.5
    assert service.memory_mb == 256
    assert service.aliases == ("db", "database")
    kinds = {(v.kind, v.target, v.read_only) for v in service.volumes}
    assert kinds == {("volume", "/data", False), ("copy", "/conf", True)}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"privileged": True}, "privileged"),
        ({"network_mode": "host"}, "network_mode"),
        ({"cap_add": ["SYS_ADMIN"]}, "cap_add"),
        (
            {"volumes": [{"type": "bind", "source": "/var/run/docker.sock", "target": "/s"}]},
            "volumes",
        ),
        ({"build": {"context": "/"}}, "build.context"),
    ],
)
def test_what_would_widen_a_container_is_refused_naming_the_field(
    task: Task, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any], field: str
) -> None:
    env = task.environment_dir.resolve()
    with pytest.raises(TaskConfigError, match=rf"services\.db\.{field}"):
        project(task, monkeypatch, db=db(env, **extra))


def test_start_order_follows_depends_on_and_refuses_cycles(
    task: Task, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = task.environment_dir.resolve()
    web = db(env, depends_on={"db": {"condition": "service_healthy"}})
    assert project(task, monkeypatch, db=db(env), web=web).start_order() == ["db", "web"]
    cyclic = db(env, depends_on={"web": {"condition": "service_started"}})
    with pytest.raises(EnvironmentStartError, match="cycle"):
        project(task, monkeypatch, db=cyclic, web=web).start_order()


def test_go_durations() -> None:
    assert compose.go_duration("1m30s", where="x") == 90.0
    assert compose.go_duration("250ms", where="x") == 0.25
    with pytest.raises(EnvironmentStartError):
        compose.go_duration("soon", where="x")


def test_trial_starts_sidecars_first_on_the_trials_network_and_removes_everything(
    task: Task, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = task.environment_dir.resolve()
    patch_model(monkeypatch, model(env, db=db(env)))
    runtime = FakeRuntime()
    result = run_trial(runtime, TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "trials")))
    assert result.exception_info is None, result.exception_info
    containers = list(runtime.containers.values())
    sidecar, main = containers[0], containers[1]
    assert sidecar.spec.labels[LABEL_KIND] == "sidecar" and main.spec.labels[LABEL_KIND] == "trial"
    assert sidecar.spec.labels[LABEL_TRIAL] == main.spec.labels[LABEL_TRIAL] == result.trial_name
    # The trial container's limits (the sidecar's own lower memory wins) and network.
    assert sidecar.spec.pids_limit == main.spec.pids_limit
    assert sidecar.spec.memory_mb == 256 and sidecar.spec.cpus == main.spec.cpus
    assert sidecar.spec.network_name == main.spec.network_name is not None
    assert "database" in sidecar.spec.aliases and "main" in main.spec.aliases
    assert sidecar.spec.process is not None and sidecar.spec.healthcheck is not None
    assert sidecar.files["/conf/app.ini"] == b"[app]\n"  # the bind's copy, before start
    assert [v.target for v in sidecar.spec.volumes] == ["/data"]
    assert all(c.removed for c in containers)
    assert runtime.networks == {} and runtime.trial_volumes == {}
    # Public task: the network routes out, like Harbor's project network.
    assert runtime.calls.index("create_network") < runtime.calls.index("create")


def test_an_unhealthy_sidecar_fails_the_environment_and_leaves_nothing(
    task: Task, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = task.environment_dir.resolve()
    patch_model(monkeypatch, model(env, db=db(env)))
    runtime = FakeRuntime(health=lambda container: "unhealthy")
    result = run_trial(runtime, TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "trials")))
    assert result.exception_type == "EnvironmentStartError"
    assert all(c.removed for c in runtime.containers.values())
    assert runtime.networks == {} and runtime.trial_volumes == {}


def test_main_waits_until_its_dependency_is_healthy(
    task: Task, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = task.environment_dir.resolve()
    patch_model(monkeypatch, model(env, db=db(env)))
    healthy = threading.Event()
    runtime = FakeRuntime(health=lambda c: "healthy" if healthy.is_set() else "starting")
    worker = threading.Thread(
        target=run_trial,
        args=(runtime, TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "t"))),
    )
    worker.start()
    try:
        for _ in range(1000):  # bounded: 10 s
            if "container_status" in runtime.calls or not worker.is_alive():
                break
            worker.join(0.01)
        assert "container_status" in runtime.calls
        assert len(runtime.containers) == 1  # the sidecar only: main waits
    finally:
        healthy.set()
        worker.join(10)
    assert len(runtime.containers) == 2


def test_cancel_mid_agent_removes_sidecars_network_and_volumes(
    task: Task, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = task.environment_dir.resolve()
    patch_model(monkeypatch, model(env, db=db(env)))
    runtime = FakeRuntime(solve=lambda container: HOLD)
    trial = Trial(runtime, TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "t")))
    worker = threading.Thread(target=trial.run)
    worker.start()
    assert runtime.gate.wait_held(1)
    trial.cancel()
    worker.join(10)
    assert all(c.removed for c in runtime.containers.values())
    assert runtime.networks == {} and runtime.trial_volumes == {}


def test_no_network_task_gets_an_internal_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_task(tmp_path, "offline", toml="[environment]\nnetwork_mode = 'no-network'\n")
    (root / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    task = load_task(root)
    env = task.environment_dir.resolve()
    patch_model(monkeypatch, model(env, cache={"image": "python:3.11-slim-bookworm"}))
    seen: list[dict[str, str]] = []
    runtime = FakeRuntime()
    original = runtime.create_network

    def record(name: str, labels: Any, *, internal: bool) -> str:
        seen.append({"internal": str(internal)})
        return original(name, labels, internal=internal)

    runtime.create_network = record  # type: ignore[method-assign]
    result = run_trial(runtime, TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "t")))
    assert result.exception_info is None, result.exception_info
    assert seen == [{"internal": "True"}]


def test_a_separate_verifier_gets_a_fresh_compose_project(
    task: Task, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Harbor 0.26 starts a whole new environment from environment/ for a separate
    verifier: new sidecars and network; the agent's are gone before it starts."""
    env = task.environment_dir.resolve()
    patch_model(monkeypatch, model(env, db=db(env)))
    runtime = FakeRuntime()
    created_networks: list[str] = []
    original = runtime.create_network

    def record(name: str, labels: Any, *, internal: bool) -> str:
        created_networks.append(name)
        return original(name, labels, internal=internal)

    runtime.create_network = record  # type: ignore[method-assign]
    policy = SandboxPolicy(verifier_mode="separate")
    result = run_trial(
        runtime, TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "t", policy=policy))
    )
    assert result.exception_info is None, result.exception_info
    assert result.verifier_environment_mode == "separate"
    kinds = [c.spec.labels[LABEL_KIND] for c in runtime.containers.values()]
    assert kinds == ["sidecar", "trial", "sidecar", "verifier"]
    assert len(set(created_networks)) == 2
    verifier = list(runtime.containers.values())[3]
    assert verifier.spec.network_name == created_networks[1]
    assert all(c.removed for c in runtime.containers.values())
    assert runtime.networks == {} and runtime.trial_volumes == {}


def test_multi_step_separate_verifiers_keep_the_agents_project_and_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-step compose task with separate verifiers: each step's verifier gets a
    project of its own while the agent's (kept for the next step) stays up; every one
    of them is removed in the end."""
    steps = {name: ("true", "echo 1 > /logs/verifier/reward.txt") for name in ("one", "two")}
    root = make_multi_step_task(
        tmp_path / "tasks", "ms-compose", steps, toml='[verifier]\nenvironment_mode = "separate"\n'
    )
    env = root / "environment"
    (env / "db").mkdir()
    (env / "db" / "Dockerfile").write_text("FROM python:3.11-slim-bookworm\n")
    (env / "conf").mkdir()
    (env / "docker-compose.yaml").write_text("services:\n  db:\n    build: ./db\n")
    task = load_task(root)
    snapshot = task.environment_dir.resolve()
    patch_model(monkeypatch, model(snapshot, db=db(snapshot)))
    sidecars_at_solve: list[int] = []

    def solve(container: Any) -> int:
        sidecars_at_solve.append(
            sum(
                c.spec.labels[LABEL_KIND] == "sidecar" and not c.removed
                for c in runtime.containers.values()
            )
        )
        return 0

    runtime = FakeRuntime(solve=solve)
    live_at_verifier: list[int] = []
    original = runtime.create_network

    def record(name: str, labels: Any, *, internal: bool) -> str:
        live_at_verifier.append(len(runtime.networks))
        return original(name, labels, internal=internal)

    runtime.create_network = record  # type: ignore[method-assign]
    result = run_trial(runtime, TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "t")))
    assert result.exception_info is None, result.exception_info
    assert [s.verifier_result.rewards for s in result.step_results or [] if s.verifier_result] == [
        {"reward": 1},
        {"reward": 1},
    ]
    # The agent's network, then one per verifier; the agent's lived through step one's.
    assert live_at_verifier == [0, 1, 0], live_at_verifier
    assert sidecars_at_solve == [1, 1], "step two's agent lost its sidecar"
    assert all(c.removed for c in runtime.containers.values())
    assert runtime.networks == {} and runtime.trial_volumes == {}


def test_prewarm_builds_every_service_image(task: Task, monkeypatch: pytest.MonkeyPatch) -> None:
    env = task.environment_dir.resolve()
    patch_model(monkeypatch, model(env, db=db(env), cache={"image": "redis:7"}))
    runtime = FakeRuntime()
    outcome = prewarm_one(runtime, task)
    assert outcome.status == "built", outcome.detail
    assert outcome.detail == compose.main_image_tag(task)
    assert len(runtime.builds) == 2  # main and db; redis:7 is only looked up
    assert {b.split(":")[0] for b in runtime.builds} == {"harbor-exec/env", "harbor-exec/service"}
    assert "redis:7" in runtime.images
    assert prewarm_one(runtime, task).status == "cached"
