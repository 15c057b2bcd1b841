"""The order in which the root conftest.py hands tests to xdist (no pytest hooks here)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from typing import Literal

import pytest

#: The file (its path in this variable) where an xdist worker that ran engine tests
#: says so; the controller then checks what they left on the engine (tests/conftest.py).
LEFTOVERS_ENV = "HARBOR_EXEC_TEST_LEFTOVERS"
#: The lock file (its path in this variable) by which a test marked ``quiet_engine`` has
#: the engine to its own group: no ``engine_lane`` test runs beside it.
QUIET_ENV = "HARBOR_EXEC_TEST_QUIET"


@contextlib.contextmanager
def engine_turn(kind: Literal["quiet", "beside"]) -> Iterator[None]:
    """Hold the engine as a timed test ("quiet": alone but for its own group) or as a
    second-lane test ("beside": with the other group, never during a timed test).

    A reader-writer lock across the xdist workers (``flock``), with a turnstile so
    that a timed test waits only for the second lane's current test, never for a
    stream of them."""
    path = os.environ.get(QUIET_ENV)
    if not path:
        yield
        return
    with open(path + ".turnstile", "a") as turnstile, open(path, "a") as quiet:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(quiet, fcntl.LOCK_EX if kind == "quiet" else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(quiet, fcntl.LOCK_UN)


def _seconds(item: pytest.Item) -> float:
    marker = item.get_closest_marker("long")
    return float(marker.args[0]) if marker is not None and marker.args else 0.0


def long_first(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """``items`` in the order that spreads the long tests over ``workers``.

    xdist's worksteal scheduler first hands each worker a contiguous batch, the
    pending count divided by the workers left; each batch here starts with its
    share of the long tests, longest first. The other tests keep their order.
    """
    long = sorted((item for item in items if _seconds(item) > 0), key=_seconds, reverse=True)
    rest = iter(item for item in items if _seconds(item) == 0)
    ordered: list[pytest.Item] = []
    for worker in range(workers):
        size = (len(items) - len(ordered)) // (workers - worker)
        batch = long[worker::workers]
        batch += [item for _, item in zip(range(size - len(batch)), rest, strict=False)]
        ordered += batch
    ordered += rest
    return ordered
