"""Image builds against a real engine: BuildKit through the Engine API, the legacy
fallback, failing fast, build logs, and parallel prewarm."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.errors import EnvironmentStartTimeoutError, SandboxBuildFailedError
from harbor_exec.jobs.dataset import is_full_reward
from harbor_exec.jobs.prewarm import prewarm_tasks, tally
from harbor_exec.sandbox import docker as docker_runtime_module
from harbor_exec.sandbox.deps import DEPS_VOLUME_PREFIX
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.images import build_cache_report
from harbor_exec.sandbox.runtime import LABEL_KIND, LABEL_MANAGED, ContainerSpec
from harbor_exec.tasks.discovery import discover_tasks
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import Trial, TrialRequest, image_tag_for
from tests.task_factory import make_task

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "tasks_examples" / "dataset"

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]


@pytest.fixture(scope="module")
def legacy() -> Iterator[DockerRuntime]:
    runtime = DockerRuntime(builder="legacy")
    yield runtime
    runtime.remove_owned()
    runtime.close()


@pytest.fixture()
def made_images(docker_runtime: DockerRuntime) -> Iterator[list[str]]:
    """Tags a test made; removed afterwards."""
    tags: list[str] = []
    yield tags
    for tag in tags:
        docker_runtime.remove_image(tag)


def build(runtime: DockerRuntime, context: Path, tags: list[str], timeout: float = 120) -> str:
    tag = f"harbor-exec-test/build:{uuid.uuid4().hex[:16]}"
    tags.append(tag)
    runtime.ensure_image(
        context_dir=context, tag=tag, timeout_sec=timeout, labels={LABEL_KIND: "test"}
    )
    return tag


def context(tmp_path: Path, dockerfile: str, files: dict[str, str] | None = None) -> Path:
    root = tmp_path / uuid.uuid4().hex[:8]
    root.mkdir()
    (root / "Dockerfile").write_text(dockerfile)
    for name, text in (files or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_builder_is_chosen_once_per_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = DockerRuntime()
    assert runtime.builder == "buildkit"  # Docker 20.10, API 1.41: BuildKit is there
    assert runtime.engine_info()["builder"] == "buildkit"
    runtime.close()
    monkeypatch.setenv("HARBOR_EXEC_BUILDER", "legacy")
    forced = DockerRuntime()
    assert forced.builder == "legacy"
    forced.close()
    monkeypatch.setenv("HARBOR_EXEC_BUILDER", "fast")
    with pytest.raises(ValueError, match=r"HARBOR_EXEC_BUILDER.*auto, buildkit, legacy"):
        DockerRuntime()


def test_refused_buildkit_falls_back_to_legacy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made_images: list[str]
) -> None:
    runtime = DockerRuntime()
    real = DockerRuntime._run_build
    seen: list[str] = []

    def refusing(self: DockerRuntime, builder: str, *args: Any) -> None:
        seen.append(builder)
        if builder == "buildkit":  # what an engine with BuildKit disabled answers
            raise docker_runtime_module._BuildkitUnavailable("buildkit is not enabled on daemon")
        real(self, builder, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DockerRuntime, "_run_build", refusing)
    ctx = context(tmp_path, f"FROM debian:bookworm-slim\nRUN echo {uuid.uuid4().hex} > /x\n")
    tag = build(runtime, ctx, made_images)
    assert runtime.image_exists(tag)
    assert seen == ["buildkit", "legacy"] and runtime.builder == "legacy"
    build(
        runtime,
        context(tmp_path, f"FROM debian:bookworm-slim\nRUN echo {uuid.uuid4().hex}\n"),
        made_images,
    )
    assert seen == ["buildkit", "legacy", "legacy"]  # chosen once: no second BuildKit try
    assert docker_runtime_module._refuses_buildkit("buildkit is not enabled on daemon")
    assert not docker_runtime_module._refuses_buildkit('"/tests" not found: not found')
    runtime.close()


def _fingerprint(runtime: DockerRuntime, tag: str) -> tuple[dict[str, Any], str]:
    """An image's config and a listing (path, mode, owner, checksum) of what tasks add."""
    config = runtime._api.inspect_image(tag)["Config"]
    kept = {k: config.get(k) for k in ("Env", "Cmd", "Entrypoint", "WorkingDir", "User", "Labels")}
    container = runtime.create(
        ContainerSpec(image=tag, name=f"hx-fp-{uuid.uuid4().hex[:8]}", labels={})
    )
    try:
        runtime.start(container)
        listing = runtime.exec(
            container,
            [
                "sh",
                "-c",
                "for d in /app /data /srv /opt /usr/local/bin; do [ -e $d ] && "
                "find $d -xdev -exec stat -c '%n %a %U %F' {} + ; done | sort; "
                "find /app /data /srv -xdev -type f -exec md5sum {} + 2>/dev/null | sort",
            ],
            user="0",
        ).output.decode()
    finally:
        runtime.remove(container)
    return kept, listing


def test_example_dataset_same_image_from_both_builders(
    docker_runtime: DockerRuntime, legacy: DockerRuntime, tmp_path: Path, made_images: list[str]
) -> None:
    tasks = discover_tasks(EXAMPLES).tasks
    assert len(tasks) == 7
    for task in tasks:
        assert task.dockerfile is not None
        new = build(docker_runtime, task.environment_dir, made_images)
        old = build(legacy, task.environment_dir, made_images)
        assert _fingerprint(docker_runtime, new) == _fingerprint(legacy, old), task.name
        # And both run the task's oracle trial to the same full reward.
        for image in (new, old):
            result = run_trial(
                docker_runtime,
                TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "t", image=image)),
            )
            assert is_full_reward(result), (task.name, result.exception_info)


@pytest.mark.quiet_engine  # a wall-clock bound on engine work
def test_missing_copy_source_fails_fast_naming_the_path(
    docker_runtime: DockerRuntime, tmp_path: Path, made_images: list[str]
) -> None:
    # The slow step before the COPY is never run: BuildKit checks sources first.
    ctx = context(
        tmp_path,
        f"FROM debian:bookworm-slim\nRUN echo {uuid.uuid4().hex} && sleep 30\nCOPY tests/ /tests\n",
    )
    started = time.monotonic()
    with pytest.raises(SandboxBuildFailedError) as info:
        build(docker_runtime, ctx, made_images)
    assert time.monotonic() - started < 2
    message = str(info.value)
    assert '"/tests" not found' in message
    assert "COPY tests/ /tests" in message  # the step that failed


@pytest.mark.parametrize("builder", ["buildkit", "legacy"])
def test_failing_run_keeps_its_output(
    builder: str,
    docker_runtime: DockerRuntime,
    legacy: DockerRuntime,
    tmp_path: Path,
    made_images: list[str],
) -> None:
    runtime = docker_runtime if builder == "buildkit" else legacy
    nonce = uuid.uuid4().hex
    ctx = context(
        tmp_path,
        "FROM debian:bookworm-slim\n"
        f"RUN echo {nonce}; for i in $(seq 1 300); do echo line-$i; done; "
        "echo about-to-fail >&2; exit 42\n",
    )
    with pytest.raises(SandboxBuildFailedError) as info:
        build(runtime, ctx, made_images)
    message = str(info.value)
    assert "42" in message and "about-to-fail" in message
    log_path = runtime.cache_dir / "build-logs" / f"{made_images[-1].replace('/', '_')}.log"
    log = log_path.read_text()
    # The whole output is in the log file; the message only carries its tail.
    assert nonce in log and "line-1\n" in log.replace("#", "\n").replace(" line-1", "\nline-1")
    assert "line-300" in log and "line-150" not in message
    assert len(message.splitlines()) < 40


def test_a_failed_stage_is_named_with_its_own_error(
    docker_runtime: DockerRuntime, tmp_path: Path, made_images: list[str]
) -> None:
    """Stage ``a`` fails while ``b`` still runs, so BuildKit cancels ``b``: the message
    names ``a``, whose error it quotes, and the log calls ``b`` CANCELED."""
    nonce = uuid.uuid4().hex[:8]
    ctx = context(
        tmp_path,
        "FROM debian:bookworm-slim AS a\n"
        f"RUN sleep 1 && echo {nonce} && exit 3\n"
        "FROM debian:bookworm-slim AS b\n"
        f"RUN sleep 20 && echo {nonce} > /b\n"
        "FROM debian:bookworm-slim\n"
        "COPY --from=a /etc/hostname /a\n"
        "COPY --from=b /b /b\n",
    )
    with pytest.raises(SandboxBuildFailedError) as info:
        build(docker_runtime, ctx, made_images)
    first = str(info.value).splitlines()[0]
    assert f"at step '[a 2/2] RUN sleep 1 && echo {nonce} && exit 3'" in first, first
    assert "exit code: 3" in first
    log_path = docker_runtime.cache_dir / "build-logs" / f"{made_images[-1].replace('/', '_')}.log"
    log = log_path.read_text()
    assert " CANCELED" in log and "ERROR: " in log
    assert "context canceled" not in first


def test_buildkit_image_keeps_labels_and_is_built_once(
    docker_runtime: DockerRuntime, tmp_path: Path, made_images: list[str]
) -> None:
    ctx = context(
        tmp_path,
        f"FROM debian:bookworm-slim\nCOPY a.txt /a.txt\nRUN echo {uuid.uuid4().hex}\n",
        {"a.txt": "a\n", ".dockerignore": "secret.txt\n", "secret.txt": "no\n"},
    )
    tag = build(docker_runtime, ctx, made_images)
    labels = docker_runtime._api.inspect_image(tag)["Config"]["Labels"]
    assert labels[LABEL_MANAGED] == "true" and labels[LABEL_KIND] == "test"
    assert docker_runtime.build_counts[tag] == 1
    again = docker_runtime.ensure_image(context_dir=ctx, tag=tag, timeout_sec=60, labels={})
    assert not again.built and docker_runtime.build_counts[tag] == 1
    # .dockerignore holds for BuildKit too.
    probe = context(tmp_path, f"FROM {tag}\nCOPY secret.txt /s\n", {})
    (probe / "secret.txt").write_text("x")
    (probe / ".dockerignore").write_text("secret.txt\n")
    with pytest.raises(SandboxBuildFailedError, match=r"secret\.txt"):
        build(docker_runtime, probe, made_images)


def test_buildkit_build_timeout(
    docker_runtime: DockerRuntime, tmp_path: Path, made_images: list[str]
) -> None:
    ctx = context(tmp_path, f"FROM debian:bookworm-slim\nRUN echo {uuid.uuid4().hex}; sleep 60\n")
    started = time.monotonic()
    with pytest.raises(EnvironmentStartTimeoutError, match="build_timeout_sec=3"):
        build(docker_runtime, ctx, made_images, timeout=3)
    assert time.monotonic() - started < 15


def _dataset(root: Path, n_unique: int, nonce: str) -> Path:
    """``n_unique`` distinct environments, two tasks sharing each of the first two."""
    for i in range(n_unique):
        make_task(
            root, f"t{i:02d}", dockerfile=f"FROM debian:bookworm-slim\nRUN echo {nonce} {i} > /id\n"
        )
    for i in range(2):
        make_task(
            root, f"twin{i}", dockerfile=f"FROM debian:bookworm-slim\nRUN echo {nonce} {i} > /id\n"
        )
    make_task(root, "zz-broken", dockerfile="FROM debian:bookworm-slim\nCOPY missing/ /m\n")
    return root


@pytest.mark.quiet_engine  # a wall-clock bound on engine work
def test_parallel_prewarm_builds_each_tag_once(
    docker_runtime: DockerRuntime, tmp_path: Path, made_images: list[str]
) -> None:
    nonce = uuid.uuid4().hex
    tasks = discover_tasks(_dataset(tmp_path / "ds", 8, nonce)).tasks
    tags = {image_tag_for(t) for t in tasks if t.name != "zz-broken"}
    made_images.extend(tags)
    assert len(tasks) == 11 and len(tags) == 8
    active = 0
    most = 0
    guard = threading.Lock()
    real = docker_runtime._build

    def counting(*args: Any) -> None:
        nonlocal active, most
        with guard:
            active += 1
            most = max(most, active)
        try:
            real(*args)
        finally:
            with guard:
                active -= 1

    docker_runtime._build = counting  # type: ignore[method-assign,assignment]
    try:
        outcomes = prewarm_tasks(docker_runtime, tasks, jobs=4)
    finally:
        del docker_runtime._build
    assert most > 1  # builds overlapped
    assert tally(outcomes) == {"built": 8, "cached": 2, "failed": 1}
    assert all(docker_runtime.build_counts[tag] == 1 for tag in tags)
    broken = next(o for o in outcomes if o.task == "zz-broken")
    assert broken.status == "failed" and "missing" in broken.reason
    started = time.monotonic()
    again = prewarm_tasks(docker_runtime, [t for t in tasks if t.name != "zz-broken"], jobs=4)
    assert time.monotonic() - started < 1
    assert tally(again) == {"built": 0, "cached": 10, "failed": 0}
    assert all(docker_runtime.build_counts[tag] == 1 for tag in tags)


def test_prewarm_cli_progress_summary_and_second_run(
    docker_runtime: DockerRuntime, tmp_path: Path, made_images: list[str]
) -> None:
    nonce = uuid.uuid4().hex
    ds = _dataset(tmp_path / "ds", 8, nonce)
    made_images.extend(image_tag_for(t) for t in discover_tasks(ds).tasks if t.name != "zz-broken")
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    cli = [sys.executable, "-m", "harbor_exec.cli", "prewarm", str(ds), "--jobs", "3"]
    first = subprocess.run(cli, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 1, first.stdout + first.stderr
    out = first.stdout
    # With no option, through the package cache: the legacy builder, which runs the
    # steps in the cache's gateway (docs/package-cache.md).
    assert "built: 8, cached: 2, failed: 1" in out
    assert "with 3 job(s), builder legacy (through the package cache)" in out
    flat = " ".join(out.split())  # the live line's reason, however the terminal wraps it
    assert "failed zz-broken" in out and "file not found in build context" in flat
    assert "built t00" in out
    second = subprocess.run([*cli[:-2]], capture_output=True, text=True, timeout=120, env=env)
    assert "built: 0, cached: 10, failed: 1" in second.stdout


def test_harbor_backend_prewarm_installs_a_shared_requirement_set_once(
    tmp_path: Path, made_images: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Three tasks, one requirement set: three task images, one dependency environment
    (a read-only volume, never an image built FROM each task image)."""
    from harbor_exec.backends.harbor.backend import HarborBackend
    from harbor_exec.bundler import build_bundle
    from harbor_exec.executors.local import LocalExecutor
    from tests.bundle_utils import EXAMPLE_DIR, EXAMPLE_REFS

    bundle = build_bundle(EXAMPLE_DIR, cache_dir=tmp_path / "bundles", **EXAMPLE_REFS)
    nonce = uuid.uuid4().hex
    for i in range(3):
        make_task(
            tmp_path / "ds",
            f"py{i}",
            dockerfile=f"FROM python:3.11-slim-bookworm\nRUN echo {nonce} {i} > /id\nWORKDIR /app\n",
        )
    backend = HarborBackend(
        tasks_dir=tmp_path / "ds",
        task_mode="dataset",
        agent=EXAMPLE_REFS["workflow"],
        bundle=bundle,
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
    )
    assert isinstance(backend.executor, LocalExecutor)
    runtime = backend.executor.runtime
    assert isinstance(runtime, DockerRuntime)
    runtime.remove_volume(
        DEPS_VOLUME_PREFIX + bundle.requirements_digest[:24]
    )  # installed by an earlier test: install it here
    real_build, real_fill = runtime.ensure_image, runtime.fill_volume
    fills: list[bool] = []

    def building(**kwargs: Any) -> Any:
        made_images.append(kwargs["tag"])
        return real_build(**kwargs)

    def filling(fill: Any, image: str) -> bool:
        filled = real_fill(fill, image)
        fills.append(filled)
        return filled

    runtime.ensure_image = building  # type: ignore[method-assign]
    runtime.fill_volume = filling  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="harbor_exec.backends.harbor.backend"):
        summary = asyncio.run(backend.prewarm(jobs=3))
    assert (
        sum("prewarm py" in r.getMessage() and "built in" in r.getMessage() for r in caplog.records)
        == 3
    )
    assert summary.failed == 0 and summary.built == 3, summary
    assert backend.image_builds == 4  # three task images, one dependency environment
    assert fills.count(True) == 1 and len(fills) == 3, fills
    assert len(made_images) == 3  # no image is built FROM a task image for dependencies
    assert set(summary.seconds) == {"py0", "py1", "py2"}
    assert backend.health().image_builder == "buildkit"
    again = asyncio.run(backend.prewarm(jobs=3))
    assert again.cached == 3 and backend.image_builds == 4
    for tag in made_images:
        runtime.remove_image(tag)
    made_images.clear()


def test_images_prune_reports_the_build_cache(docker_runtime: DockerRuntime) -> None:
    records, size = docker_runtime.build_cache_usage()
    assert records > 0 and size >= 0  # this session's BuildKit builds left cache records
    # Only records unused for ten thousand hours: nothing another build on this engine needs.
    assert docker_runtime.prune_build_cache(older_than="10000h") == 0
    report = build_cache_report(docker_runtime, prune=False)
    assert report.startswith("build cache left: ") and "--build-cache removes" in report


def test_images_prune_removes_stale_runtime_and_dependency_volumes(
    docker_runtime: DockerRuntime,
) -> None:
    """Stale runtime volumes and dependency environments go; the current runtime, any
    volume a container uses and any a live harbor-exec process of this host holds (it
    filled or checked it, and mounts it without asking the engine again) stay.
    (``images prune`` keeps the current runtime's volume; called on its own here, so the
    session's task images stay.)"""
    import contextlib
    import subprocess
    import sys

    import docker

    from harbor_exec.sandbox.runtime_volume import RuntimeContent

    client = docker.from_env()
    nonce = uuid.uuid4().hex[:12]
    stale = client.volumes.create(
        f"harbor-exec-runtime-stale{nonce}", labels={LABEL_KIND: "runtime"}
    )
    deps = client.volumes.create(f"harbor-exec-deps-stale{nonce}", labels={LABEL_KIND: "deps"})
    in_use = client.volumes.create(f"harbor-exec-deps-used{nonce}", labels={LABEL_KIND: "deps"})
    held = client.volumes.create(f"harbor-exec-deps-held{nonce}", labels={LABEL_KIND: "deps"})
    holder = client.containers.create(
        "debian:bookworm-slim", volumes={in_use.name: {"bind": "/x", "mode": "ro"}}
    )
    # Another process holds ``held`` as a runtime that filled it does, until told.
    hold = (
        "import sys\nfrom harbor_exec.sandbox.docker import _hold_on_this_host\n"
        f"h = _hold_on_this_host('volume-{held.name}')\nprint('held', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "held"
        current = RuntimeContent.load().volume_name
        removed = docker_runtime.prune_volumes({current})
        assert stale.name in removed and deps.name in removed
        assert in_use.name not in removed and current not in removed
        assert held.name not in removed
        names = {v.name for v in client.volumes.list()}
        assert stale.name not in names and deps.name not in names and in_use.name in names
        assert held.name in names
        process.communicate("\n", timeout=30)  # it ends: the volume is nobody's now
        assert held.name in docker_runtime.prune_volumes({current})
    finally:
        process.kill()
        holder.remove(force=True)
        in_use.remove(force=True)
        with contextlib.suppress(docker.errors.NotFound):
            held.remove(force=True)


def test_deps_in_image_bakes_the_install_into_a_layer_once(
    docker_runtime: DockerRuntime, tmp_path: Path, made_images: list[str]
) -> None:
    """``patch_dockerfile_with_sdk=True`` (``SandboxPolicy.deps_in_image``): the agent's
    container has the dependency environment in its image, not mounted; a second trial
    builds nothing; the separate verifier still gets the read-only volume."""
    from harbor_exec.bundler import build_bundle
    from harbor_exec.sandbox.deps import BAKED_IMAGE_REPO, DepsLayer
    from harbor_exec.tasks.task import load_task
    from tests.bundle_utils import EXAMPLE_DIR, EXAMPLE_REFS

    bundle = build_bundle(EXAMPLE_DIR, cache_dir=tmp_path / "bundles", **EXAMPLE_REFS)
    deps = DepsLayer(bundle.wheelhouse, bundle.manifest.pip_wheel, bundle.requirements_digest)
    nonce = uuid.uuid4().hex
    check = (
        "[ -f /opt/harbor-exec-deps/installed.txt ] || exit 1\n"
        "grep -q ' /opt/harbor-exec-deps ' /proc/mounts && echo mounted || echo baked\n"
    )
    task = make_task(
        tmp_path / "tasks",
        "baked",
        solve=f"{{ {check} }} > /logs/agent/where.txt",
        test=f"{{ {check} }} > /logs/verifier/where.txt; echo 1 > /logs/verifier/reward.txt",
        toml='[agent]\ntimeout_sec = 30.0\n[verifier]\ntimeout_sec = 30.0\nenvironment_mode = "separate"\n',
        dockerfile=f"FROM debian:bookworm-slim\nRUN echo {nonce} > /id\nWORKDIR /app\n",
    )
    built: list[int] = []
    for _ in range(2):
        spec = TrialSpec(task=load_task(task), trials_dir=tmp_path / "trials", deps=deps)
        request = TrialRequest(replace(spec, policy=replace(spec.policy, deps_in_image=True)))
        trial = Trial(docker_runtime, request)
        result = trial.run()
        assert result.exception_info is None, result.exception_info
        assert trial.image.startswith(f"{BAKED_IMAGE_REPO}:")
        made_images.append(trial.image)
        built.append(trial.images_built)
        out = tmp_path / "trials" / result.trial_name
        assert (out / "agent" / "where.txt").read_text() == "baked\n"
        assert (out / "verifier" / "where.txt").read_text() == "mounted\n"
    made_images.append(image_tag_for(load_task(task)))
    assert built[0] >= 2 and built[1] == 0, built  # task image + bake, then nothing
