"""``validate``/``run`` say which trials are running and for how long (issue 38, point 1):
on a terminal a live list under the progress bar (each running trial with its seconds,
longest first, bounded in lines); in a log a line when each starts; each finished trial's
line has its seconds (over the fake runtime, the agents held at its gate)."""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from harbor_exec.cli import helpers
from harbor_exec.cli.helpers import RunningTrials, SelectedDataset, run_dataset_job
from harbor_exec.tasks.discovery import discover_tasks
from harbor_exec.trial.spec import TrialSpec
from tests.fake_runtime import HOLD, FakeRuntime
from tests.server_utils import wait_until
from tests.task_factory import make_task

NAMES = ("held-a", "held-b", "held-c")


class Output(io.StringIO):
    """What the job printed so far, readable while it runs (written from its threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            return super().write(text)

    def text(self) -> str:
        with self.lock:
            return self.getvalue()


def run_held_job(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    terminal: bool,
    while_held: Callable[[Output], None],
) -> str:
    """``validate``'s job over three tasks whose solve.sh waits at the runtime's gate,
    printing to a console that is (or is not) a terminal; ``while_held`` runs (on a
    thread: the job has the main thread, for its signal handlers) once all three are
    held, then the gate opens. Everything printed."""
    for name in NAMES:
        make_task(tmp_path / "tasks", name)
    out = Output()
    monkeypatch.setattr(
        helpers, "console", Console(file=out, force_terminal=terminal, width=120, color_system=None)
    )
    runtime = FakeRuntime(solve=lambda container: HOLD)
    selected = SelectedDataset(discover_tasks(tmp_path / "tasks"), "tasks", None)
    failed: list[BaseException] = []

    def watch() -> None:
        try:
            assert runtime.gate.wait_held(len(NAMES))
            while_held(out)
        except BaseException as exc:
            failed.append(exc)
        finally:
            runtime.gate.open()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    run_dataset_job(
        "validate", selected, runtime,  # type: ignore[arg-type]
        jobs_dir=tmp_path / "jobs", job_name="held", n_concurrent=3, n_attempts=1,
        make_spec=lambda task, job_dir: TrialSpec(task, job_dir),
    )  # fmt: skip
    watcher.join(timeout=30)
    if failed:
        raise failed[0]
    return out.text()


def running_lines(text: str) -> dict[str, int]:
    """The running list's last lines seen: task -> its seconds."""
    return {m[0]: int(m[1]) for m in re.findall(r"running\s+(held-\w)\s+(\d+)s", text)}


def test_a_terminal_lists_running_trials_with_their_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def listed(out: Output) -> None:
        # The live display redraws (10 a second): every held trial listed, seconds going up.
        assert wait_until(lambda: set(running_lines(out.text())) == set(NAMES), timeout=10)
        assert wait_until(
            lambda: running_lines(out.text()[-2000:]).get("held-a", 0) >= 1, timeout=10
        )

    text = run_held_job(tmp_path, monkeypatch, terminal=True, while_held=listed)
    for name in NAMES:
        assert re.search(rf"passed {name} \(\d+\.\d s\)", text), text
    assert "started held-a" not in text  # a terminal has the live list instead


def test_a_log_gets_a_line_per_start_and_the_seconds_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def started(out: Output) -> None:
        assert all(f"started {name}" in out.text() for name in NAMES), out.text()

    text = run_held_job(tmp_path, monkeypatch, terminal=False, while_held=started)
    lines = text.splitlines()
    for name in NAMES:
        (finished,) = [line for line in lines if line.startswith(f"passed {name} ")]
        assert re.fullmatch(rf"passed {name} \(\d+\.\d s\)", finished), finished
    # No live display's redraws in a log: no cursor movement, no running list.
    assert "\x1b[" not in text and "running  held" not in text


def test_the_running_list_is_bounded_and_longest_first() -> None:
    clock = [100.0]
    trials = RunningTrials(clock=lambda: clock[0])
    for i in range(12):
        clock[0] += 1
        trials.start(f"task-{i}", 0)
        if i != 7:
            trials.run(f"task-{i}", 0)  # its agent started (task-7: still starting)
    trials.start("task-0", 1)  # a second attempt of a task, the newest
    clock[0] = 200.0
    table = trials.renderable(limit=8)
    assert table is not None
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(table)
    text: Any = console.file
    lines = [line.split() for line in text.getvalue().splitlines()]
    assert len(lines) == 9
    assert lines[0] == ["running", "task-0", "99s"]
    assert lines[7] == ["starting", "task-7", "92s"]
    assert trials.counts() == (2, 11)
    assert lines[8] == ["and", "5", "more"]
    assert trials.stop("task-0", 1) == pytest.approx(88.0)
    assert trials.stop("task-0", 1) is None
    for i in range(12):
        trials.stop(f"task-{i}", 0)
    assert trials.renderable() is None
