"""How the suite is selected and scheduled, for every test below.

- Every test that needs the Docker engine is marked ``docker``: a test needs it
  when it uses the ``docker_runtime`` fixture (directly or through
  ``base_images`` and the like), whatever its module says, so
  ``pytest -m "not docker"`` runs the fast suite on a machine without Docker.
  Tests that reach the engine another way (a ``harbor-exec`` subprocess) carry
  the marker in their module.
- The fast suite runs on pytest-xdist workers (``-n auto --dist worksteal`` in
  pyproject.toml: two per core, plus one, because many tests wait on timers).
  A run that selects engine tests schedules by group (``--dist loadgroup``): the
  engine tests are one group, run one at a time on one worker, because they share
  one engine and time its containers, while the other workers take the rest. The
  modules marked ``engine_lane`` (self-contained on the engine: their own tasks and
  images, no engine-wide counts, waits with wide margins) are a second group, run
  one at a time beside the first, so their idle waits (Harbor's compose runs, a Ray
  cluster's nodes coming and going, the engine tarring a flood) overlap the first
  group's work; ``engine_lane("b")`` puts a module in a third such group, so that
  the lanes end about together. A test marked ``quiet_engine`` (a tight wall-clock bound on engine
  work) runs with no second-lane test beside it: it waits for the lane's current test,
  and the lane waits for it (``tests/scheduling.py:engine_turn``); the quiet tests run
  last in their group, when the lanes are about done, so that nobody waits long. (xdist 3.8 names
  an item's group in its node id, which pytest 9 no longer reads from ``_nodeid``:
  ``_join_engine_group`` writes it where pytest 9 keeps it.) Every worker that ran
  engine tests says so to the controller, which checks for leftovers once they all
  ended.
- Tests marked ``slow`` need no engine but spend seconds of CPU in real
  subprocesses: every real build (each test that uses the ``bundle_cache``
  fixture, and harbor-exec's own wheel: pip against the package index, build
  backends in their own environments), the ``osmosis`` and schemathesis CLIs,
  the 10,000-rollout soak. The fast suite leaves them out:
  a run whose ``-m`` excludes ``docker`` and says nothing of ``slow`` deselects
  them, and says so in its header. ``--slow`` keeps them; ``-m slow`` runs only
  them; a plain ``pytest`` (CI) runs everything.
- Tests marked ``long(seconds)`` (how long each runs alone) are scheduled
  first, longest first; in a parallel run they are dealt out one by one to the
  heads of the workers' first batches, so that the run does not end waiting on
  one worker that got them all.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Literal

import pytest

from tests.scheduling import LEFTOVERS_ENV, QUIET_ENV, engine_turn, long_first

# Cache bytecode even where PYTHONDONTWRITEBYTECODE is set (some machines set it):
# otherwise every xdist worker, and every runner or `serve` subprocess the tests
# start, compiles harbor_exec and the tests anew, about a third of the fast
# suite's CPU. Subprocesses read what this process writes.
sys.dont_write_bytecode = False

ENGINE_FIXTURES = frozenset({"docker_runtime"})
ENGINE_GROUP = "engine"
SECOND_ENGINE_GROUP = "engine-lane"
BUILD_FIXTURES = frozenset({"bundle_cache"})
_EXCLUDES_ENGINE = re.compile(r"\bnot\s+docker\b")
_NAMES_SLOW = re.compile(r"\bslow\b")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="keep the tests marked slow in a run that excludes docker (the fast suite)",
    )


def _fast_suite(config: pytest.Config) -> bool:
    """Whether this run is the fast suite: engine tests excluded, slow ones not asked for."""
    markexpr = config.option.markexpr or ""
    return bool(
        _EXCLUDES_ENGINE.search(markexpr)
        and not _NAMES_SLOW.search(markexpr)
        and not config.getoption("slow")
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    if _fast_suite(config):
        return "fast suite: tests marked slow are deselected (--slow keeps them, -m slow runs them)"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Before xdist's own pytest_configure, which starts the workers.
    if not hasattr(config, "workerinput") and LEFTOVERS_ENV not in os.environ:
        # Where the worker that ran the engine tests reports what they left (tests/conftest.py).
        fd, path = tempfile.mkstemp(prefix="harbor-exec-leftovers-")
        os.close(fd)
        os.environ[LEFTOVERS_ENV] = path
    if not hasattr(config, "workerinput") and QUIET_ENV not in os.environ:
        # The timed tests' lock beside the second engine group (tests/scheduling.py).
        global _quiet_dir
        _quiet_dir = tempfile.mkdtemp(prefix="harbor-exec-quiet-")
        os.environ[QUIET_ENV] = os.path.join(_quiet_dir, "lock")
    if not hasattr(config.option, "numprocesses"):
        return  # run with -p no:xdist
    if hasattr(config, "workerinput"):
        return
    if not _EXCLUDES_ENGINE.search(config.option.markexpr or "") and config.option.numprocesses:
        # Engine tests share one engine and time its containers: they run one at a time,
        # on one worker (the group "engine"), while the other workers take the rest.
        config.option.dist = "loadgroup"


_quiet_dir: str | None = None


def pytest_unconfigure(config: pytest.Config) -> None:
    global _quiet_dir
    if _quiet_dir is not None:
        shutil.rmtree(_quiet_dir, ignore_errors=True)
        os.environ.pop(QUIET_ENV, None)
        _quiet_dir = None


def _engine_grouped(config: pytest.Config) -> bool:
    """Whether this is an xdist worker of a run whose engine tests form one group."""
    workerinput = getattr(config, "workerinput", None)
    return bool(workerinput) and not _EXCLUDES_ENGINE.search(config.option.markexpr or "")


def _join_engine_group(item: pytest.Item) -> None:
    """Put ``item`` in its xdist group ("engine", or "engine-lane" when marked
    ``engine_lane``): loadgroup reads the group after the node id's "@". pytest 9 keeps a
    node id as a NodeId whose string is cached; xdist 3.8 still sets the old ``_nodeid``
    (now unused), so the suffix goes into the cached string."""
    lane = item.get_closest_marker("engine_lane")
    group = ENGINE_GROUP
    if lane is not None:
        # ``engine_lane("b")``: a lane of its own beside the others (see the module doc).
        group = f"{SECOND_ENGINE_GROUP}-{lane.args[0]}" if lane.args else SECOND_ENGINE_GROUP
    object.__setattr__(item._id, "_str_cache", f"{item.nodeid}@{group}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test marked ``quiet_engine`` (a tight wall-clock bound on engine work) runs with
    no second-lane test beside it; a second-lane test waits while one does. Set-up and
    tear-down of its fixtures included (a Ray cluster's start is the lane's CPU too)."""
    if not _engine_grouped(item.config):
        yield
        return
    if item.get_closest_marker("quiet_engine") is not None:
        kind: Literal["quiet", "beside"] | None = "quiet"
    elif item.get_closest_marker("engine_lane") is not None:
        kind = "beside"
    else:
        kind = None
    if kind is None:
        yield
        return
    with engine_turn(kind):
        yield


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return 2 * (os.cpu_count() or 1) + 1


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouped = _engine_grouped(config)
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if ENGINE_FIXTURES & fixtures:
            item.add_marker(pytest.mark.docker)
        if BUILD_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
        if grouped and item.get_closest_marker("docker") is not None:
            _join_engine_group(item)
    if _fast_suite(config):
        kept: list[pytest.Item] = []
        slow: list[pytest.Item] = []
        for item in items:
            (kept if item.get_closest_marker("slow") is None else slow).append(item)
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = kept
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    items[:] = long_first(items, workers)
    if grouped:
        # The quiet tests last in their group: by then the other lanes are done (or on
        # their last test), so the engine group does not idle while each quiet test
        # waits for the lanes' current tests to end (measured: about 200 s of the run).
        items.sort(key=lambda item: item.get_closest_marker("quiet_engine") is not None)
