"""The migration guide's ``HarborBackend`` constructor (osmosis-ai 0.3.8's keywords):
``orchestrator=`` (a real Harbor ``TrialQueue``), ``environment_config=`` (Harbor's real
``EnvironmentConfig``), ``patch_dockerfile_with_sdk``, ``agent_setup_timeout_sec``,
``bundle=`` a path (a harbor-exec bundle, its wheel, and a bundle wheel built by
osmosis-ai's own SDK, all built here), the removed v0.2 keywords, and the guide's v0.3
entrypoint as written. Trials run on ``FakeRuntime`` (no Docker)."""

from __future__ import annotations

import asyncio
import importlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from harbor.models.job.config import RetryConfig
from harbor.models.trial.config import EnvironmentConfig
from harbor.trial.queue import TrialQueue

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.backends.harbor.constructor import REPLACED_KEYWORDS
from harbor_exec.bundler import Bundle, BundleError
from harbor_exec.bundler.prebuilt import load_bundle, osmosis_bundle_refs
from harbor_exec.bundler.wheels import build_wheel
from harbor_exec.client import RolloutClient
from harbor_exec.container.exchange import MANIFEST_PATH, frame_sample
from harbor_exec.executors.local import LocalExecutor
from harbor_exec.server.app import create_rollout_server
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.policy import ContainerLimits
from tests import bundle_utils
from tests.bundle_utils import EXAMPLE_DIR, EXAMPLE_REFS, setuptools_pyproject, write_project
from tests.fake_runtime import FakeContainer, FakeRuntime
from tests.server_utils import CHAT_URL, PROMPT, serve
from tests.task_factory import make_task

# The session's shared bundle cache and example bundle (fixtures, used by name).
bundle_cache = bundle_utils.bundle_cache
example_bundle = bundle_utils.example_bundle


def backend_for(tmp_path: Path, **options: Any) -> HarborBackend:
    task = make_task(tmp_path / "tasks", "ctor-task")
    options.setdefault("executor", LocalExecutor(FakeRuntime()))
    return HarborBackend(
        tasks_dir=task,
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        **options,
    )


def one_rollout(app: Any, rollout_id: str) -> Any:
    """One rollout of ``PROMPT`` through ``app`` served on loopback, by our client."""

    async def scenario(url: str) -> Any:
        async with httpx.AsyncClient(timeout=60) as http:
            client = RolloutClient(url=url, http_client=http)
            handle = await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id=rollout_id)
            return await handle

    with serve(app) as url:
        return asyncio.run(scenario(url))


# ----------------------------------------------------------------- orchestrator


def test_a_trial_queue_sets_the_concurrency(tmp_path: Path) -> None:
    backend = backend_for(tmp_path, orchestrator=TrialQueue(n_concurrent=3))
    assert backend.max_concurrent_trials == 3
    assert backend.queue_info().capacity == 3
    duck = backend_for(tmp_path, orchestrator=SimpleNamespace(n_concurrent=2))
    assert duck.max_concurrent_trials == 2
    same = backend_for(tmp_path, orchestrator=TrialQueue(n_concurrent=5), max_concurrent_trials=5)
    assert same.max_concurrent_trials == 5
    assert backend_for(tmp_path).max_concurrent_trials == 4  # neither: the default


def test_orchestrator_conflicts_and_retries_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"max_concurrent_trials=2 conflicts .* n_concurrent=3"):
        backend_for(tmp_path, orchestrator=TrialQueue(n_concurrent=3), max_concurrent_trials=2)
    retrying = TrialQueue(n_concurrent=2, retry_config=RetryConfig(max_retries=2))
    with pytest.raises(ValueError, match=r"retry_config.max_retries=2"):
        backend_for(tmp_path, orchestrator=retrying)
    # Harbor's default RetryConfig retries nothing: accepted.
    plain = TrialQueue(n_concurrent=2, retry_config=RetryConfig())
    assert backend_for(tmp_path, orchestrator=plain).max_concurrent_trials == 2
    with pytest.raises(TypeError, match="n_concurrent"):
        backend_for(tmp_path, orchestrator=object())
    with pytest.raises(ValueError, match="at least 1"):
        backend_for(tmp_path, orchestrator=SimpleNamespace(n_concurrent=0))


# ----------------------------------------------------------------- environment_config


def test_environment_overrides_replace_the_tasks_own(tmp_path: Path) -> None:
    config = EnvironmentConfig(override_cpus=1.5, override_memory_mb=700, force_build=True)
    backend = backend_for(tmp_path, environment_config=config)
    # A task that asks for more: Harbor's overrides replace task.toml's values.
    toml = "[environment]\ncpus = 4\nmemory_mb = 4096\nstorage_mb = 9000\n[verifier]\ntimeout_sec = 30.0\n"
    task = load_task(make_task(tmp_path / "big", "big-task", toml=toml))
    limits = ContainerLimits.resolve(backend.policy, task.config.environment)
    assert (limits.cpus, limits.memory_mb, limits.storage_mb) == (1.5, 700, 9000)
    # Without overrides the task's own win, as before.
    plain = ContainerLimits.resolve(backend_for(tmp_path).policy, task.config.environment)
    assert (plain.cpus, plain.memory_mb, plain.storage_mb) == (4.0, 4096, 9000)
    as_dict = backend_for(tmp_path, environment_config={"override_storage_mb": 1234})
    assert as_dict.policy.override_storage_mb == 1234


def test_environment_fields_that_do_not_apply_are_named(tmp_path: Path) -> None:
    cases: list[tuple[Any, str]] = [
        (EnvironmentConfig(delete=False), r"environment_config.delete=False .*cleanup_successful"),
        (EnvironmentConfig(type="daytona"), r"environment_config.type='daytona'"),
        (EnvironmentConfig(override_gpus=1), r"environment_config.override_gpus"),
        (EnvironmentConfig(env={"A": "1"}), r"environment_config.env"),
        (EnvironmentConfig(extra_allowed_hosts=["x.org"]), r"extra_allowed_hosts"),
        (EnvironmentConfig(memory_enforcement_policy="ignore"), r"memory_enforcement_policy"),
        ({"no_such_field": 1}, r"environment_config.no_such_field"),
        ({"override_cpus": -1}, r"override_cpus must be positive"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            backend_for(tmp_path, environment_config=config)
    with pytest.raises(TypeError, match="EnvironmentConfig"):
        backend_for(tmp_path, environment_config=42)
    # Harbor's defaults (type docker, delete True, force_build either way) are accepted.
    backend_for(tmp_path, environment_config=EnvironmentConfig(type="docker", force_build=False))


def test_a_rollout_runs_under_the_overrides(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    backend = backend_for(
        tmp_path,
        executor=LocalExecutor(runtime),
        environment_config=EnvironmentConfig(override_cpus=1, override_memory_mb=600),
    )
    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")

    result = one_rollout(app, "limits-1")
    assert result.status == "success", result.err_message
    specs = [c.spec for c in runtime.containers.values()]
    assert specs and all((s.cpus, s.memory_mb) == (1.0, 600) for s in specs)


# ----------------------------------------------------------------- removed keywords


def test_removed_keywords_say_what_replaces_them(tmp_path: Path) -> None:
    replacement = {
        "task_dir": "tasks_dir=",
        "dataset_path": "tasks_dir=",
        "user_code_dir": "code_dir=",
        "workflow": "agent=",
        "custom_tests_dir": "tests/",
        "prebuild_local_image": "prewarm()",
        "symlink_environment": "snapshot",
        "_sdk_source_dir": "runtime",
        "prewarm": "prewarm",
        "verified_tasks": "harbor-exec validate",
    }
    assert set(replacement) == set(REPLACED_KEYWORDS)
    for name, hint in replacement.items():
        with pytest.raises(TypeError) as caught:
            backend_for(tmp_path, **{name: "x"})
        assert str(caught.value).startswith(f"HarborBackend({name}=...)")
        assert hint in str(caught.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        backend_for(tmp_path, colour="blue")


# ----------------------------------------------------------------- patch / setup timeout


def test_patch_dockerfile_and_setup_timeout(tmp_path: Path, example_bundle: Bundle) -> None:
    with pytest.raises(ValueError, match="patch_dockerfile_with_sdk requires a bundle"):
        backend_for(tmp_path, patch_dockerfile_with_sdk=True)
    backend_for(tmp_path, patch_dockerfile_with_sdk=False)  # nothing to install: fine
    for value in (True, False, None):
        backend = backend_for(
            tmp_path,
            bundle=example_bundle,
            patch_dockerfile_with_sdk=value,
            agent_setup_timeout_sec=120.0,
        )
        backend.start()
        assert backend.bundle is not None and backend.bundle.name == EXAMPLE_REFS["workflow"]
        # True: the workflow's dependencies are baked into a layer of each task image
        # (tests/test_builds_docker.py); otherwise the read-only volume.
        assert backend.planner is not None
        assert backend.planner.policy.deps_in_image is (value is True)
    with pytest.raises(ValueError, match="agent_setup_timeout_sec must be positive"):
        backend_for(tmp_path, agent=EXAMPLE_REFS["workflow"], agent_setup_timeout_sec=0)


# ----------------------------------------------------------------- bundle= a path


def test_bundle_paths_of_a_harbor_exec_bundle(tmp_path: Path, example_bundle: Bundle) -> None:
    for given in (example_bundle.wheel, str(example_bundle.root)):
        backend = backend_for(tmp_path, bundle=given)  # agent omitted: the bundle's
        backend.start()
        assert backend.bundle is not None
        assert backend.bundle.name == EXAMPLE_REFS["workflow"]
        assert backend.bundle.key == f"b-agent-{example_bundle.digest}"
        assert backend.bundle.has_grader
    named = backend_for(tmp_path, bundle=example_bundle.wheel, agent=EXAMPLE_REFS["workflow"])
    named.start()
    other = backend_for(tmp_path, bundle=example_bundle.wheel, agent="arith_agent.workflow:Other")
    with pytest.raises(ValueError, match="differs from the bundle's"):
        other.start()
    with pytest.raises(ValueError, match="the oracle runs no bundle"):
        backend_for(tmp_path, bundle=example_bundle.wheel, agent="oracle")


def test_a_copied_or_damaged_bundle_wheel(tmp_path: Path, example_bundle: Bundle) -> None:
    root = tmp_path / "copy"
    shutil.copytree(example_bundle.root, root)
    wheel = root / "wheel" / example_bundle.wheel.name
    assert load_bundle(wheel).digest == example_bundle.digest
    wheel.write_bytes(wheel.read_bytes() + b"\0")
    with pytest.raises(BundleError, match=r"does not match its manifest.json"):
        load_bundle(wheel)


def test_a_wheel_that_is_no_bundle_is_named(tmp_path: Path) -> None:
    project = write_project(
        tmp_path / "plain",
        {"pyproject.toml": setuptools_pyproject("plain-lib"), "plain_lib/__init__.py": "X = 1\n"},
    )
    wheel = build_wheel(project, tmp_path / "out", what="plain-lib")
    with pytest.raises(BundleError, match=rf"bundle {wheel} is not a bundle"):
        backend_for(tmp_path, bundle=wheel)  # refused at construction, before any build
    with pytest.raises(BundleError, match=rf"bundle {wheel} is not a bundle"):
        load_bundle(wheel)
    with pytest.raises(BundleError, match="no such file"):
        load_bundle(tmp_path / "missing.whl")
    with pytest.raises(BundleError, match=r"bundle .*missing.whl: no such file"):
        backend_for(tmp_path, bundle=tmp_path / "missing.whl")
    with pytest.raises(BundleError, match=r"the directory has no manifest\.json"):
        backend_for(tmp_path, bundle=project)
    not_a_wheel = tmp_path / "notes.txt"
    not_a_wheel.write_text("hello\n")
    with pytest.raises(BundleError, match="neither a bundle directory"):
        backend_for(tmp_path, bundle=str(not_a_wheel))


def osmosis_wheel(tmp_path: Path) -> Path:
    """The example project bundled by osmosis-ai 0.3.8's own bundler."""
    from osmosis_ai.packaging import build_bundle as osmosis_build_bundle

    return osmosis_build_bundle(
        EXAMPLE_DIR,
        workflow=EXAMPLE_REFS["workflow"],
        grader=EXAMPLE_REFS["grader"],
        workflow_config=EXAMPLE_REFS["workflow_config"],
        grader_config=EXAMPLE_REFS["grader_config"],
        bundles_dir=tmp_path / "osmosis-bundles",
    )


def test_an_osmosis_sdk_bundle_wheel(tmp_path: Path, bundle_cache: Path) -> None:
    wheel = osmosis_wheel(tmp_path)
    assert osmosis_bundle_refs(wheel) == EXAMPLE_REFS
    bundle = load_bundle(wheel, cache_dir=bundle_cache)
    manifest = bundle.manifest
    assert (manifest.workflow, manifest.grader) == (
        EXAMPLE_REFS["workflow"],
        EXAMPLE_REFS["grader"],
    )
    assert manifest.workflow_config == EXAMPLE_REFS["workflow_config"]
    assert manifest.requirements == ["httpx>=0.27"]  # the wheel's Requires-Dist
    assert manifest.grader_only == ["arith_agent/grader.py"]
    # osmosis-ai's shim is not carried over; the project's modules are.
    import zipfile

    names = zipfile.ZipFile(bundle.wheel).namelist()
    assert "arith_agent/workflow.py" in names and "arith_agent/bundle_main.py" not in names
    # The same wheel again: the cached bundle.
    assert load_bundle(wheel, cache_dir=bundle_cache).digest == bundle.digest


def test_a_rollout_through_an_osmosis_bundle_wheel(tmp_path: Path) -> None:
    wheel = osmosis_wheel(tmp_path)
    seen: list[dict[str, Any]] = []

    def runner(container: FakeContainer) -> tuple[int, bytes]:
        seen.append(json.loads(container.read(MANIFEST_PATH) or b"{}"))
        sample = {"messages": [{"role": "assistant", "content": "4"}]}
        return 0, frame_sample(json.dumps(sample).encode())

    runtime = FakeRuntime(runner=runner)
    backend = backend_for(tmp_path, executor=LocalExecutor(runtime), bundle=str(wheel))
    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")

    result = one_rollout(app, "osm-1")
    assert result.status == "success", result.err_message
    assert seen and seen[0]["workflow"] == EXAMPLE_REFS["workflow"]
    assert seen[0]["grader"] is None  # the agent's copy never names the grader


# ----------------------------------------------------------------- the guide's entrypoint


def test_the_guides_v03_entrypoint_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The migration guide's v0.3 ``HarborBackend`` block (section 2, then section 6's
    server), verbatim but for the import, from a project checkout laid out as it assumes
    (``.`` the project, ``tasks/my-task`` the template task)."""
    project = tmp_path / "checkout"
    shutil.copytree(EXAMPLE_DIR, project)
    make_task(project / "tasks", "my-task")
    monkeypatch.chdir(project)
    monkeypatch.setenv("HARBOR_EXEC_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    monkeypatch.syspath_prepend(str(project / "src"))
    # The guide's names, from the example project (not installed: imported from src/).
    grader_module = importlib.import_module("arith_agent.grader")
    workflow_module = importlib.import_module("arith_agent.workflow")
    MyGrader = grader_module.ArithGrader
    my_grader_config = grader_module.grader_config
    MyWorkflow = workflow_module.ArithWorkflow
    my_workflow_config = workflow_module.workflow_config

    trial_queue = TrialQueue(n_concurrent=2)

    # --- as written in the guide, harbor-exec's import substituted -----------------
    from harbor_exec.backends.harbor import HarborBackend

    backend = HarborBackend(
        orchestrator=trial_queue,
        tasks_dir=Path("tasks/my-task"),
        task_mode="template",
        agent=MyWorkflow,
        workflow_config=my_workflow_config,
        grader=MyGrader,
        grader_config=my_grader_config,
        code_dir=Path("."),
        cleanup_successful_trials=True,
    )
    # --- end of the guide's block ----------------------------------------------------
    assert backend.max_concurrent_trials == 2
    assert backend.tasks_dir == project / "tasks" / "my-task"

    # One rollout through it, on FakeRuntime instead of this machine's Docker engine.
    seen: list[dict[str, Any]] = []

    def runner(container: FakeContainer) -> tuple[int, bytes]:
        seen.append(json.loads(container.read(MANIFEST_PATH) or b"{}"))
        sample = {"messages": [{"role": "assistant", "content": "4"}]}
        return 0, frame_sample(json.dumps(sample).encode())

    runtime = FakeRuntime(runner=runner)
    backend.executor = LocalExecutor(runtime)

    # --- section 6, as written, harbor-exec's import substituted --------------------
    from harbor_exec.server.app import create_rollout_server

    app = create_rollout_server(
        backend=backend,
        lifespan=backend.prewarm_lifespan(),
    )
    # --------------------------------------------------------------------------------

    result = one_rollout(app, "guide-1")
    assert result.status == "success", result.err_message
    assert [m["workflow"] for m in seen] == ["arith_agent.workflow:ArithWorkflow"]
    assert seen[0]["workflow_config"] == "arith_agent.workflow:workflow_config"
    assert backend.bundle is not None and backend.bundle.has_grader
    assert runtime.builds  # prewarm built the task image before serving


def test_the_guides_task_mode_snippets_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Section 3's template and dataset constructors and section 6's dataset lifespan,
    verbatim but for the import (``code_dir`` omitted: found from the workflow class)."""
    project = tmp_path / "checkout"
    shutil.copytree(EXAMPLE_DIR, project)
    make_task(project / "tasks", "my-task")
    for task_id in ("task-a", "task-b"):
        make_task(project / "tasks", task_id)
    monkeypatch.chdir(project)
    monkeypatch.setenv("HARBOR_EXEC_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    monkeypatch.syspath_prepend(str(project / "src"))
    MyWorkflow = importlib.import_module("arith_agent.workflow").ArithWorkflow
    trial_queue = TrialQueue(n_concurrent=3)

    from harbor_exec.backends.harbor import HarborBackend
    from harbor_exec.server.app import create_rollout_server

    backend = HarborBackend(
        orchestrator=trial_queue,
        tasks_dir=Path("tasks/my-task"),
        task_mode="template",
        agent=MyWorkflow,
    )
    assert backend.task_mode == "template" and backend.max_concurrent_trials == 3

    backend = HarborBackend(
        orchestrator=trial_queue,
        tasks_dir=Path("tasks"),
        task_mode="dataset",
        agent=MyWorkflow,
    )
    app = create_rollout_server(
        backend=backend,
        lifespan=backend.prewarm_lifespan(["task-a", "task-b"]),
    )
    assert app is not None and backend.task_mode == "dataset"
    backend.executor = LocalExecutor(FakeRuntime())  # no engine: the fast suite runs without one
    backend.start()  # the bundle, built from the project found from MyWorkflow
    assert backend.bundle is not None
    assert backend.bundle.name == "arith_agent.workflow:ArithWorkflow"


def test_the_command_channel_is_on_unless_turned_off(tmp_path: Path) -> None:
    """Every trial container's commands go over its command channel by default;
    ``command_channel=False`` (``--no-command-channel``) runs each through the engine."""
    from harbor_exec.backends.harbor.constructor import harbor_config

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    on = harbor_config(tasks_dir=tasks, agent="oracle").sandbox
    off = harbor_config(tasks_dir=tasks, agent="oracle", command_channel=False).sandbox
    assert on.command_channel is True and off.command_channel is False
    policy = off.policy(max_concurrent_trials=1, pid_max=4096)
    assert policy.command_channel is False


def test_warm_containers_are_on_unless_turned_off(tmp_path: Path) -> None:
    """Every entry point keeps warm containers by default (``--warm-containers``, the
    constructor's ``warm_containers``); 0 turns the pool off, and the policy each trial
    carries (to this engine or a Ray node) says so."""
    from harbor_exec.backends.harbor.constructor import harbor_config

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    on = harbor_config(tasks_dir=tasks, agent="oracle").sandbox
    off = harbor_config(tasks_dir=tasks, agent="oracle", warm_containers=0).sandbox
    assert on.warm_containers == 4 and off.warm_containers == 0
    assert on.policy(max_concurrent_trials=1, pid_max=4096).warm_containers == 4
    assert off.policy(max_concurrent_trials=1, pid_max=4096).warm_containers == 0
