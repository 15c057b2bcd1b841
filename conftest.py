"""Marks every test that needs the Docker engine with ``docker``.

A test needs the engine when it uses the ``docker_runtime`` fixture (directly or
through ``base_images`` and the like), whatever its module says, so
``pytest -m "not docker"`` runs the fast suite on a machine without Docker. Tests
that reach the engine another way (a ``harbor-exec`` subprocess) carry the marker
in their module. Here rather than in tests/conftest.py: it holds for every test below.
"""

from __future__ import annotations

import pytest

ENGINE_FIXTURES = frozenset({"docker_runtime"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.docker)
