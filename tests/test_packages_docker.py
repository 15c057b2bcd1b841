"""``validate -t org/name@ref`` and ``-d org/dataset@ref`` through a package source,
on a real engine: the oracle earns reward 1 in Harbor's job layout, and a package
whose content does not match its digest is refused before any image or container."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import docker
import pytest

from harbor_exec.cli.serve import ServeOptions, build_harbor_backend
from harbor_exec.sandbox.runtime import LABEL_TASK
from harbor_exec.server.app import create_rollout_server
from tests.cli_utils import run_cli
from tests.package_utils import HELLO, add_dataset, add_task
from tests.server_utils import serve, task_rollout

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]


def trial_results(job: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(job.glob("*/result.json"))]


def test_validate_runs_a_package_task_and_a_dataset_package(tmp_path: Path) -> None:
    packages = tmp_path / "packages"
    hello = add_task(packages, HELLO, "acme/hello", tags={"latest": "self"})
    dataset = add_dataset(packages, "acme/set", {"acme/hello": hello}, tags={"v1": "self"})
    jobs = tmp_path / "jobs"

    done = run_cli(
        "validate",
        "-t",
        "acme/hello",
        "--package-source",
        str(packages),
        "--jobs-dir",
        str(jobs),
        "--job-name",
        "t",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((jobs / "t" / "config.json").read_text())
    assert config["datasets"] == []
    assert config["tasks"] == [
        {"name": "acme/hello", "ref": "latest", "digest": hello, "package_source": str(packages)}
    ]
    [result] = trial_results(jobs / "t")
    assert result["task_id"] == {"org": "acme", "name": "hello", "ref": "latest"}
    assert result["verifier_result"]["rewards"]["reward"] == 1.0
    trial_dir = Path(str(result["trial_uri"]).removeprefix("file://"))
    trial_config = json.loads((trial_dir / "config.json").read_text())
    assert trial_config["task"] == {"name": "acme/hello", "ref": "latest", "source": None}
    assert json.loads((jobs / "t" / "result.json").read_text())["n_total_trials"] == 1

    done = run_cli(
        "validate",
        "-d",
        "acme/set@v1",
        "--package-source",
        str(packages),
        "--jobs-dir",
        str(jobs),
        "--job-name",
        "d",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((jobs / "d" / "config.json").read_text())
    assert config["datasets"] == [
        {"name": "acme/set", "ref": dataset, "package_source": str(packages)}
    ]
    [result] = trial_results(jobs / "d")
    assert result["task_id"] == {"org": "acme", "name": "hello", "ref": hello}
    assert result["source"] == "acme/set"
    assert result["verifier_result"]["rewards"]["reward"] == 1.0


def test_a_digest_mismatch_is_refused_before_any_build(tmp_path: Path) -> None:
    # A task no engine has seen (its own Dockerfile), so any build would be new.
    task = tmp_path / "fresh"
    shutil.copytree(HELLO, task)
    dockerfile = task / "environment" / "Dockerfile"
    marker = uuid.uuid4().hex
    dockerfile.write_text(dockerfile.read_text() + f"\nLABEL fresh={marker}\n")
    packages = tmp_path / "packages"
    digest = add_task(packages, task, "acme/fresh", tags={"latest": "self"})
    hello = add_task(packages, HELLO, "acme/hello")
    add_dataset(packages, "acme/set", {"acme/hello": hello, "acme/fresh": digest})
    (packages / "acme" / "fresh" / digest[7:] / "solution" / "solve.sh").write_text("exit 0\n")
    client = docker.from_env()
    try:
        # This task's own image and containers (other engine tests may run beside it).
        built = {"label": f"fresh={marker}"}
        ran = {"label": LABEL_TASK}
        for args in (("-t", f"acme/fresh@{digest}"), ("-d", "acme/set")):
            done = run_cli(
                "validate",
                *args,
                "--package-source",
                str(packages),
                "--jobs-dir",
                str(tmp_path / "jobs"),
                cwd=tmp_path,
            )
            assert done.returncode == 2, done.stdout + done.stderr
            assert "package acme/fresh: digest mismatch" in done.stdout
            assert digest in done.stdout
        assert client.images.list(all=True, filters=built) == []
        # The engine's list alone: the SDK's full one inspects every lane's containers.
        listed = client.containers.list(all=True, filters=ran, sparse=True)
        tasks = [(c.attrs.get("Labels") or {}).get(LABEL_TASK, "") for c in listed]
        assert not [name for name in tasks if name.endswith("fresh")], tasks
        assert not (tmp_path / "jobs").exists()
    finally:
        client.close()


def test_a_rollout_runs_a_package_named_by_harbor_task(tmp_path: Path) -> None:
    """``serve --package-source``'s backend: ``metadata.harbor_task`` ``org/name@ref``."""
    packages = tmp_path / "packages"
    digest = add_task(packages, HELLO, "acme/hello", tags={"stable": "self"})
    served = tmp_path / "served"
    served.mkdir()
    options = ServeOptions(
        tasks_dir=served,
        task_mode="dataset",
        agent="oracle",
        trials_dir=tmp_path / "trials",
        artifact_root=tmp_path / "artifacts",
        package_source=str(packages),
    )
    backend = build_harbor_backend(options)
    backend.cleanup_successful_trials = False  # keep the trial's result.json to read

    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    with serve(app) as url:
        result = task_rollout(url, {"harbor_task": "acme/hello@stable"})
        assert result.status.value == "success", result.err_message
        assert result.sample.reward == 1.0
        refused = task_rollout(url, {"harbor_task": "acme/hello@9"})
    assert refused.status.value != "success"
    assert "no such revision" in str(refused.err_message)
    recorded = [json.loads(p.read_text()) for p in (tmp_path / "trials").glob("*/result.json")]
    assert [r["task_id"] for r in recorded] == [{"org": "acme", "name": "hello", "ref": "stable"}]
    assert backend.resolver.packages is not None
    assert backend.resolver.packages.location == str(packages)
    assert (backend.resolver.packages.cache_dir / "acme" / "hello" / digest[7:]).is_dir()
