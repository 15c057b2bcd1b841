"""``harbor-exec init task|project``: a start that is valid as it stands."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from harbor_exec.bundler.project import check_ref, load_project
from harbor_exec.bundler.split import grader_split
from harbor_exec.cli.app import app
from harbor_exec.tasks.task import load_task


def test_init_task_writes_a_task_that_loads_and_refuses_to_overwrite(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["init", "task", "hello", "--dir", str(tmp_path / "hello")])
    assert result.exit_code == 0, result.output
    task = load_task(tmp_path / "hello")
    assert task.has_tests and task.config.agent.timeout_sec == 600.0
    assert (tmp_path / "hello" / "solution" / "solve.sh").stat().st_mode & 0o111
    again = CliRunner().invoke(app, ["init", "task", "hello", "--dir", str(tmp_path / "hello")])
    assert again.exit_code == 2 and "not empty" in again.output
    bad = CliRunner().invoke(app, ["init", "task", "Bad Name"])
    assert bad.exit_code == 2 and "lowercase" in bad.output


def test_init_project_writes_the_osmosis_layout_whose_refs_resolve(tmp_path: Path) -> None:
    root = tmp_path / "my-rollout"
    result = CliRunner().invoke(app, ["init", "project", "my-rollout", "--dir", str(root)])
    assert result.exit_code == 0, result.output
    project = load_project(root)
    refs = {
        "workflow": "my_rollout.main:Workflow",
        "grader": "my_rollout.main:Answer",
        "workflow_config": "my_rollout.main:workflow_config",
        "grader_config": None,
    }
    for field, ref in refs.items():
        if ref is not None:
            check_ref(project, field, ref)
    # One module, as osmosis-ai writes it: it bundles, the grader's source readable.
    assert grader_split(project, refs).exposed
