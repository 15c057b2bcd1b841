"""Shared fixtures: the fake chat endpoint, the real Docker engine, base images, and a
leftover check.

A test that needs Docker fails (never skips) when the engine is missing: a
skipped engine test would hide a broken install step. After a session that ran
engine tests no container, network or volume of ours may remain;
``pytest_sessionfinish`` turns any leftover into a failing exit status.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from harbor_exec.errors import DockerUnavailableError
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.images import bootstrap
from harbor_exec.sandbox.runtime import LABEL_MANAGED
from tests.fake_chat import FakeChat
from tests.package_upstream import AptSigner
from tests.scheduling import LEFTOVERS_ENV
from tests.setup_files import TEST_PACKAGE_PATTERNS, TEST_PACKAGES, require_setup_files

if TYPE_CHECKING:
    from harbor_exec.network.packages.ca import LocalCA


@pytest.fixture(autouse=True)
def _own_data_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test's ``serve`` processes keep rollout state in a fresh dir of their own
    (the default under ~/.local/state is owned by one server at a time)."""
    monkeypatch.setenv("HARBOR_EXEC_DATA_DIR", str(tmp_path_factory.mktemp("data-dir")))


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    """A fake OpenAI-compatible chat endpoint on 127.0.0.1 (``tests/fake_chat.py``),
    one per module; tests pick its behaviour with ``chat.reset(...)``."""
    with FakeChat() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def docker_runtime() -> Iterator[DockerRuntime]:
    try:
        runtime = DockerRuntime()
    except DockerUnavailableError as exc:
        pytest.fail(f"this test needs a Docker engine: {exc}", pytrace=False)
    yield runtime
    runtime.remove_owned()
    runtime.close()


@pytest.fixture(scope="session")
def base_images(docker_runtime: DockerRuntime) -> dict[str, str]:
    """The base images the example tasks build on (bootstrapped when missing)."""
    return bootstrap(docker_runtime, log=lambda line: None)


@pytest.fixture(scope="session")
def test_packages() -> dict[str, list[Path]]:
    """The real packages the package cache's engine test serves (scripts/setup.sh):
    ``tests.setup_files.TEST_PACKAGE_PATTERNS`` -> the files."""
    return require_setup_files(TEST_PACKAGES, *TEST_PACKAGE_PATTERNS)


@pytest.fixture(scope="session")
def apt_signer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AptSigner]:
    """A throwaway GPG key signing the tests' Debian repos (one a session: the task
    image that trusts it is built once)."""
    with AptSigner.throwaway() as signer:
        yield signer


@pytest.fixture(scope="session")
def upstream_ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    """A CA standing in for a public one: the tests' local HTTPS upstreams present its
    certificates (one a session, like ``apt_signer``)."""
    from harbor_exec.network.packages.ca import LocalCA  # the server extra (cryptography)

    return LocalCA(tmp_path_factory.mktemp("public-ca") / "ca")


def leftovers() -> list[str]:
    """Containers, networks and volumes carrying our label."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
    except Exception:
        return []
    label = {"label": f"{LABEL_MANAGED}=true"}
    # The low-level list (one call): the high-level one inspects each container and
    # fails when a concurrent test session removes one in between.
    found = [
        f"container {(c.get('Names') or [c['Id']])[0].lstrip('/')}"
        for c in client.api.containers(all=True, filters=label)
    ]
    found += [f"network {n.name}" for n in client.networks.list(filters=label)]
    found += [f"volume {v.name}" for v in client.volumes.list(filters=label)]
    client.close()
    return found


_ran_engine_tests = False


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _ran_engine_tests
    if item.get_closest_marker("docker") is not None:
        _ran_engine_tests = True


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Only a run that ran engine tests asks the engine (the fast suite's may share the
    # engine with an outer session's containers). Under xdist the workers of the engine
    # groups say so through a file, and the controller asks once every worker ended (a
    # worker that finished early would see the other group's containers at work).
    report = os.environ.get(LEFTOVERS_ENV)
    is_worker = hasattr(session.config, "workerinput")
    if session.config.option.collectonly:
        if not is_worker and report and os.path.exists(report):
            os.unlink(report)
        return
    if is_worker and report:
        if _ran_engine_tests:
            with open(report, "a", encoding="utf-8") as out:
                out.write("ran engine tests\n")
        return
    ran = _ran_engine_tests
    if report and os.path.exists(report):
        ran = ran or bool(Path(report).read_text(encoding="utf-8").strip())
        os.unlink(report)
    remaining = leftovers() if ran else []
    if remaining:
        print("\nharbor-exec objects left behind after the test session:", *remaining, sep="\n  ")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
