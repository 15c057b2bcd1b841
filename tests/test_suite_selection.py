"""How the root conftest.py selects the fast suite: engine tests and slow tests left out."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _pytest.mark.structures import Mark

from tests.scheduling import LEFTOVERS_ENV, QUIET_ENV, long_first

ROOT = Path(__file__).resolve().parent.parent


def _collect(*args: str) -> set[str]:
    """Node ids that ``pytest --collect-only`` selects with ``args``."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-n", "0", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return {line for line in done.stdout.splitlines() if "::" in line}


def test_fast_suite_leaves_out_engine_and_slow_tests() -> None:
    fast = _collect("-m", "not docker")
    in_fast = {nodeid.split("::")[0] for nodeid in fast}

    assert "tests/test_trials_docker.py" not in in_fast
    # Trials through the fake runtime are the core of the fast suite.
    assert "tests/test_trials_fake.py" in in_fast
    # A real bundle build (it uses the bundle_cache fixture) and the soak are slow.
    slow_ones = {
        "tests/test_bundler.py::test_example_bundle_layout_and_manifest",
        "tests/test_server_memory.py::test_memory_returns_to_baseline_after_10000_rollouts",
    }
    for nodeid in slow_ones:
        module, name = nodeid.split("::")
        assert f"def {name}(" in (ROOT / module).read_text(), nodeid
    assert not slow_ones & fast
    # The bundler's checks of bad projects need no build and stay in.
    assert "tests/test_bundler.py::test_no_pyproject" in fast


class _Item:
    """What ``long_first`` reads of a test item: its ``long`` marker."""

    def __init__(self, name: str, seconds: float = 0.0) -> None:
        self.name = name
        self.marker = pytest.mark.long(seconds).mark if seconds else None

    def get_closest_marker(self, name: str) -> Mark | None:
        return self.marker if name == "long" else None


def test_long_tests_head_each_workers_first_batch() -> None:
    items = [_Item(f"t{i}") for i in range(9)]
    items[7] = _Item("long5", 5)
    items[2] = _Item("long9", 9)
    items[5] = _Item("long1", 1)
    ordered = [item.name for item in long_first(items, 3)]  # type: ignore[arg-type]
    # xdist's worksteal hands out batches of 3, 3, 3: each starts with a long test.
    assert ordered == ["long9", "t0", "t1", "long5", "t3", "t4", "long1", "t6", "t8"]
    serial = [item.name for item in long_first(items, 1)]  # type: ignore[arg-type]
    assert serial[:3] == ["long9", "long5", "long1"]
    assert sorted(serial) == sorted(item.name for item in items)


class _Collected(_Item):
    """A collected item as the root conftest's hook sees it: fixtures and markers."""

    def __init__(self, name: str, *fixtures: str) -> None:
        super().__init__(name)
        self.fixturenames = ["tmp_path", *fixtures]
        self.added: list[str] = []

    def add_marker(self, marker: Any) -> None:
        self.added.append(marker.name)

    def get_closest_marker(self, name: str) -> Mark | None:
        return pytest.mark.slow.mark if name == "slow" and "slow" in self.added else None


def _modify(markexpr: str, *, slow: bool = False) -> tuple[list[_Collected], list[Any]]:
    """Run the root conftest's collection hook on three items; returns (kept, deselected)."""
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    deselected: list[Any] = []
    config = SimpleNamespace(
        option=SimpleNamespace(markexpr=markexpr),
        getoption=lambda name: slow if name == "slow" else None,
        hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)),
    )
    items = [
        _Collected("engine", "docker_runtime"),
        _Collected("build", "bundle_cache"),
        _Collected("plain"),
    ]
    root_conftest.pytest_collection_modifyitems(config, items)
    return items, deselected


def test_fixtures_mark_engine_and_build_tests() -> None:
    items, deselected = _modify("not docker")
    # The fast suite drops the build; deselecting "docker" is the -m expression's job.
    assert [item.name for item in items] == ["engine", "plain"]
    assert [item.name for item in deselected] == ["build"]
    engine, plain = items
    assert engine.added == ["docker"]
    assert deselected[0].added == ["slow"]
    assert plain.added == []


@pytest.mark.parametrize(
    ("markexpr", "slow"), [("not docker", True), ("not docker and slow", False), ("", False)]
)
def test_slow_tests_stay_when_asked_for_or_outside_the_fast_suite(
    markexpr: str, slow: bool
) -> None:
    items, deselected = _modify(markexpr, slow=slow)
    assert [item.name for item in items] == ["engine", "build", "plain"]
    assert deselected == []


def test_engine_tests_run_on_one_worker_while_the_others_take_the_rest(tmp_path: Path) -> None:
    record = tmp_path / "workers.txt"
    # The probe's run has its own quiet lock and leftovers file: with this suite's (the
    # variables this run set), its quiet test would wait for this suite's engine lanes.
    inherited = {k: v for k, v in os.environ.items() if k not in (QUIET_ENV, LEFTOVERS_ENV)}
    env = {
        **inherited,
        "ENGINE_GROUP_PROBE": str(record),
        "DOCKER_HOST": "unix:///nonexistent",  # the leftover check finds no engine to ask
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3",
         "tests/engine_group_probe.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.split() for line in record.read_text().splitlines()]
    ran = {name: worker for name, worker in lines if "=" not in name}
    assert len(ran) == 13
    engine_workers = {worker for name, worker in ran.items() if name.startswith("engine")}
    assert len(engine_workers) == 1 and engine_workers != {"main"}, ran
    # The second lane's modules run one at a time too, on one worker of their own group.
    lane_workers = {worker for name, worker in ran.items() if name.startswith("lane")}
    assert len(lane_workers) == 1 and lane_workers != {"main"}, ran
    # ...and never while a test marked quiet_engine runs.
    when = dict((n.split("=")[0], float(n.split("=")[1])) for n, _ in lines if "=" in n)
    quiet = (when["quiet-start"], when["quiet-end"])
    for n in range(4):
        lane = (when[f"lane{n}-start"], when[f"lane{n}-end"])
        assert lane[1] <= quiet[0] or quiet[1] <= lane[0], (lane, quiet)
