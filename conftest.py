"""How the suite is selected and scheduled, for every test below.

- Every test that needs the Docker engine is marked ``docker``: a test needs it
  when it uses the ``docker_runtime`` fixture (directly or through
  ``base_images`` and the like), whatever its module says, so
  ``pytest -m "not docker"`` runs the fast suite on a machine without Docker.
  Tests that reach the engine another way (a ``harbor-exec`` subprocess) carry
  the marker in their module.
- The fast suite runs on pytest-xdist workers (``-n auto`` in pyproject.toml:
  one per core, plus one, because many tests wait on timers); a run that
  selects engine tests runs in one process, because those tests share one
  engine and time its containers.
- Tests marked ``long(seconds)`` (how long each runs alone) are scheduled
  first, longest first, one per worker (``--maxschedchunk 1``), so that a
  parallel run does not end waiting on one of them.
"""

from __future__ import annotations

import os
import re

import pytest

ENGINE_FIXTURES = frozenset({"docker_runtime"})
_EXCLUDES_ENGINE = re.compile(r"\bnot\s+docker\b")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Before xdist's own pytest_configure, which starts the workers.
    if not hasattr(config.option, "numprocesses"):
        return  # run with -p no:xdist
    if not _EXCLUDES_ENGINE.search(config.option.markexpr or ""):
        config.option.numprocesses = 0
        config.option.dist = "no"
        config.option.tx = []


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return (os.cpu_count() or 1) + 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.docker)
    # A stable sort: the other tests keep their collected order.
    items.sort(key=_seconds_first)


def _seconds_first(item: pytest.Item) -> float:
    marker = item.get_closest_marker("long")
    return -float(marker.args[0]) if marker is not None and marker.args else 0.0
