"""``validate``/``run``'s ``-r/--max-retries`` (Harbor's): a trial that ended with an
exception Harbor's policy retries runs again as a new trial; one that did not, or that
the policy does not retry, is final (fake runtime; the CLI's wiring: its option)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from typer.testing import CliRunner

from harbor_exec.cli.app import app
from harbor_exec.jobs.dataset import JobEvent, run_job
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.trial import image_tag_for
from tests.fake_runtime import FakeRuntime
from tests.task_factory import make_task


def _failing_builds(runtime: FakeRuntime, tag: str, times: int) -> None:
    """The image build of ``tag`` fails its first ``times`` attempts."""
    real = runtime.ensure_image
    left = [times]

    def ensure_image(*args: Any, **kwargs: Any) -> Any:
        if left[0] > 0:
            left[0] -= 1
            runtime.fail_builds.add(tag)
        try:
            return real(*args, **kwargs)
        finally:
            runtime.fail_builds.discard(tag)

    runtime.ensure_image = ensure_image  # type: ignore[method-assign]


def _run(tmp_path: Path, runtime: FakeRuntime, max_retries: int) -> tuple[Any, list[str]]:
    task = load_task(tmp_path / "tasks" / "flaky")
    events: list[JobEvent] = []
    outcome = run_job(
        runtime,
        [task],
        jobs_dir=tmp_path / "jobs",
        job_name=f"r{max_retries}",
        n_concurrent=1,
        max_retries=max_retries,
        on_event=events.append,
    )
    kinds = [e.kind for e in events if e.kind in ("retry", "finished")]
    return outcome, kinds


def test_a_failed_build_is_retried_as_a_new_trial(tmp_path: Path) -> None:
    task = load_task(make_task(tmp_path / "tasks", "flaky"))
    runtime = FakeRuntime()
    _failing_builds(runtime, image_tag_for(task), times=2)
    outcome, kinds = _run(tmp_path, runtime, max_retries=2)
    assert kinds == ["retry", "retry", "finished"]
    [result] = outcome.results
    assert result.exception_info is None and result.reward == 1.0
    # The failed trials' directories are gone (Harbor removes them too): one trial left.
    trials = [d for d in (tmp_path / "jobs" / "r2").iterdir() if d.is_dir()]
    assert [d.name for d in trials] == [result.trial_name]


def test_retries_stop_at_the_bound_and_the_last_one_counts(tmp_path: Path) -> None:
    task = load_task(make_task(tmp_path / "tasks", "flaky"))
    runtime = FakeRuntime()
    _failing_builds(runtime, image_tag_for(task), times=5)
    outcome, kinds = _run(tmp_path, runtime, max_retries=1)
    assert kinds == ["retry", "finished"]
    [result] = outcome.results
    assert result.exception_info is not None
    assert result.exception_info.exception_type == "SandboxBuildFailedError"


def test_no_retry_by_default_nor_for_what_the_policy_keeps(tmp_path: Path) -> None:
    make_task(tmp_path / "tasks", "flaky", test="echo 0 > /logs/verifier/reward.txt")
    task = load_task(tmp_path / "tasks" / "flaky")
    runtime = FakeRuntime()
    _failing_builds(runtime, image_tag_for(task), times=1)
    outcome, kinds = _run(tmp_path, runtime, max_retries=0)
    assert kinds == ["finished"]
    assert outcome.results[0].exception_info is not None
    # A plain reward of 0 is an outcome, never retried.
    outcome, kinds = _run(tmp_path, FakeRuntime(), max_retries=3)
    assert kinds == ["finished"] and outcome.results[0].exception_info is None


def test_validate_and_run_take_harbors_option() -> None:
    group = typer.main.get_group(app)
    for name in ("validate", "run"):
        params = {p.name: p for p in group.commands[name].params}
        assert params["max_retries"].opts == ["-r", "--max-retries"] and (
            params["max_retries"].default == 0
        ), name
        shown = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200"}).output
        assert "--max-retries" in shown, name
