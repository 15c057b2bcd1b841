"""Run only by tests/test_suite_selection.py: four tests marked ``docker`` (they need no
engine), two of them ``engine_lane`` too, and four plain ones, each recording which
xdist worker ran it."""

from __future__ import annotations

import os
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
@pytest.mark.parametrize("n", range(2))
def test_engine_lane(n: int) -> None:
    _record(f"lane{n}")
