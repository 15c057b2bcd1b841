"""The order in which the root conftest.py hands tests to xdist (no pytest hooks here)."""

from __future__ import annotations

import pytest

#: The file (its path in this variable) where an xdist worker that ran engine tests
#: says so; the controller then checks what they left on the engine (tests/conftest.py).
LEFTOVERS_ENV = "HARBOR_EXEC_TEST_LEFTOVERS"


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
