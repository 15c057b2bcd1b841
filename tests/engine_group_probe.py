"""Run only by tests/test_suite_selection.py: tests marked ``docker`` (they need no
engine), some of them ``engine_lane`` or ``quiet_engine`` too, and plain ones, each
recording which xdist worker ran it; the lane and quiet ones also record when they ran."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


def _record(name: str) -> None:
    with Path(os.environ["ENGINE_GROUP_PROBE"]).open("a", encoding="utf-8") as out:
        out.write(f"{name} {os.environ.get('PYTEST_XDIST_WORKER', 'main')}\n")


@pytest.mark.docker
@pytest.mark.parametrize("n", range(4))
def test_engine(n: int) -> None:
    _record(f"engine{n}")


@pytest.mark.parametrize("n", range(4))
def test_plain(n: int) -> None:
    _record(f"plain{n}")


@pytest.mark.docker
@pytest.mark.engine_lane
@pytest.mark.parametrize("n", range(4))
def test_engine_lane(n: int) -> None:
    _record(f"lane{n}")
    _record(f"lane{n}-start={time.monotonic()}")
    time.sleep(0.5)  # long enough for the quiet test to start beside it, were it let
    _record(f"lane{n}-end={time.monotonic()}")


@pytest.mark.docker
@pytest.mark.quiet_engine
def test_engine_quiet() -> None:
    _record("engine-quiet")
    # Once a lane test has started (or it cannot: then the lock held it back), run.
    deadline = time.monotonic() + 5
    record = Path(os.environ["ENGINE_GROUP_PROBE"])
    while "-start" not in record.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    _record(f"quiet-start={time.monotonic()}")
    time.sleep(0.3)
    _record(f"quiet-end={time.monotonic()}")
