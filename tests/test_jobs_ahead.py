"""``validate``/``run`` start their next trials ahead of a slot (``harbor_exec.jobs.ahead``):
the gate's rules, then a job over the fake runtime whose first agent is held. On the
engine: ``tests/test_validate_cli.py``."""

from __future__ import annotations

import threading
from pathlib import Path

from harbor_exec.jobs.ahead import RunSlots, Turn
from harbor_exec.jobs.dataset import JobOutcome, run_job
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from tests.fake_runtime import HOLD, FakeRuntime, hold_first_removal
from tests.server_utils import wait_until
from tests.task_factory import make_task


def kind(turn: Turn) -> str:
    return turn.kind  # read afresh (the gate changes it)


def _admit_in_thread(gate: RunSlots, memory_mb: int = 0) -> threading.Event:
    admitted = threading.Event()

    def admit() -> None:
        if gate.admit(memory_mb) is not None:
            admitted.set()

    threading.Thread(target=admit, daemon=True).start()
    return admitted


def test_slots_then_places_ahead_then_nothing_until_a_trial_ends() -> None:
    gate = RunSlots(slots=1, ahead=2, ahead_memory_mb=10_000)
    first, second, third = (gate.admit(100) for _ in range(3))
    assert first is not None and kind(first) == "runner"
    assert second is not None and kind(second) == "ahead"
    assert third is not None and kind(third) == "ahead"
    fourth = _admit_in_thread(gate, 100)
    assert not fourth.wait(0.2)  # no slot and no place ahead
    never = threading.Event()
    first.wait(never)
    assert kind(first) == "running"
    # A trial ahead whose environment is up first takes the slot first.
    third_running = threading.Thread(target=third.wait, args=(never,), daemon=True)
    third_running.start()
    assert not fourth.wait(0.1)
    first.done()
    third_running.join(5)
    assert kind(third) == "running"
    assert fourth.wait(5)  # its place ahead was freed
    second.done()
    third.done()


def test_a_place_ahead_needs_its_memory_and_a_cancel_wakes_the_waiter() -> None:
    gate = RunSlots(slots=1, ahead=3, ahead_memory_mb=1000)
    runner = gate.admit(600)
    ahead = gate.admit(600)
    assert runner is not None and ahead is not None and kind(ahead) == "ahead"
    over_budget = _admit_in_thread(gate, 600)
    assert not over_budget.wait(0.2)  # 1200 MB ahead would pass the bound
    assert gate.admit(400) is not None  # 1000 MB: within it
    cancelled = threading.Event()
    waiter = threading.Thread(target=ahead.wait, args=(cancelled,), daemon=True)
    waiter.start()
    cancelled.set()
    waiter.join(5)
    assert not waiter.is_alive() and kind(ahead) == "ahead"  # it took no slot
    gate.stop()
    assert gate.admit(0) is None


def _held_job(
    tmp_path: Path, tasks: int, warm_containers: int
) -> tuple[FakeRuntime, threading.Event, list[JobOutcome]]:
    """A job of ``tasks`` one at a time whose agents wait at the runtime's gate, on a
    thread; returns once the first agent is held (the event: the job ended)."""
    loaded = [load_task(make_task(tmp_path / "tasks", f"t{i}")) for i in range(tasks)]
    runtime = FakeRuntime(solve=lambda container: HOLD)
    policy = SandboxPolicy(warm_containers=warm_containers)
    done = threading.Event()
    outcome: list[JobOutcome] = []

    def job() -> None:
        outcome.append(
            run_job(
                runtime,
                loaded,
                jobs_dir=tmp_path / "jobs",
                n_concurrent=1,
                make_spec=lambda task, job_dir: TrialSpec(task, job_dir, policy=policy),
            )
        )
        done.set()

    threading.Thread(target=job, daemon=True).start()
    assert runtime.gate.wait_held(1)
    return runtime, done, outcome


def test_the_next_trials_containers_start_while_the_first_agent_runs(tmp_path: Path) -> None:
    """One slot, two ahead: while the first trial's agent is held, the next two trials'
    containers are created and started (the second and third trial wait, agents not
    started), a fourth is not begun; every trial then runs, one agent at a time."""
    runtime, done, outcome = _held_job(tmp_path, 5, warm_containers=2)

    def started() -> list[str]:
        return [cid for cid, c in runtime.containers.items() if c.running]

    assert wait_until(lambda: len(started()) == 3, timeout=10), runtime.containers
    assert len(runtime.containers) == 3  # nothing of a fourth trial
    assert len(runtime.gate.held) == 1  # one agent runs
    runtime.gate.open()
    assert done.wait(30)
    assert [r.reward for r in outcome[0].results] == [1.0] * 5


def test_no_trial_starts_ahead_with_warm_containers_off(tmp_path: Path) -> None:
    runtime, done, _outcome = _held_job(tmp_path, 3, warm_containers=0)
    assert len(runtime.containers) == 1
    runtime.gate.open()
    assert done.wait(30)
    assert len(runtime.containers) == 3


def test_a_trial_gives_its_slot_back_when_its_reward_is_read(tmp_path: Path) -> None:
    """The removal of a trial's containers is clean-up: with one slot, the next trial's
    agent starts while the first trial's container is still being removed (before, the
    slot was held until the removal ended: about 0.1 to 0.5 s of every trial, idle)."""
    loaded = [load_task(make_task(tmp_path / "tasks", f"t{i}")) for i in range(2)]
    runtime = FakeRuntime()
    removal_held, release = hold_first_removal(runtime)
    outcome: list[JobOutcome] = []
    job = threading.Thread(
        target=lambda: outcome.append(
            run_job(
                runtime,
                loaded,
                jobs_dir=tmp_path / "jobs",
                n_concurrent=1,
                make_spec=lambda task, job_dir: TrialSpec(
                    task, job_dir, policy=SandboxPolicy(warm_containers=0)
                ),
            )
        ),
        daemon=True,
    )
    job.start()
    assert removal_held.wait(10)

    def solves() -> int:
        return sum("solve.sh" in e.script for e in runtime.execs)

    try:
        assert wait_until(lambda: solves() == 2, timeout=5), "the slot waited for the removal"
    finally:
        release.set()
    job.join(30)
    assert [r.reward for r in outcome[0].results] == [1.0, 1.0]
