"""Shared helpers for the bundler and runner tests (no conftest: imported explicitly).

``example_bundle`` is a session fixture: the cold build of the example project
(tens of seconds at worst) happens once per session, in one cache directory
that every test of the session shares (the dependency wheelhouse and the
runtime wheel are reused from it too).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.bundler import Bundle, build_bundle

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = REPO_ROOT / "tasks_examples" / "workflow_project"
EXAMPLE_SRC = EXAMPLE_DIR / "src"
EXAMPLE_REFS: dict[str, Any] = {
    "workflow": "arith_agent.workflow:ArithWorkflow",
    "grader": "arith_agent.grader:ArithGrader",
    "workflow_config": "arith_agent.workflow:workflow_config",
    "grader_config": "arith_agent.grader:grader_config",
}
# The container's Python: pyenv's 3.11 here, Debian's python3.11 on a bare bookworm machine.
PYTHON311_CANDIDATES = (
    Path("/root/.pyenv/versions/3.11.7/bin/python3"),
    Path(shutil.which("python3.11") or "/usr/bin/python3.11"),
)
PYTHON311 = next((p for p in PYTHON311_CANDIDATES if p.is_file()), PYTHON311_CANDIDATES[0])
API_KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="session")
def bundle_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # getbasetemp() is one directory per session, so every importer shares it; under
    # pytest-xdist it is one per worker, and the workers share their parent (the
    # cache is safe for concurrent builders).
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "bundle-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def example_bundle(bundle_cache: Path) -> Bundle:
    return build_bundle(EXAMPLE_DIR, cache_dir=bundle_cache, **EXAMPLE_REFS)


def write_project(root: Path, files: Mapping[str, str]) -> Path:
    """Write a project: ``{relative path: text}``, dedented."""
    for relpath, text in files.items():
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return root


def setuptools_pyproject(name: str, dependencies: list[str] | None = None) -> str:
    deps = json.dumps(dependencies or [])
    return f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{name}"
        version = "0.1.0"
        requires-python = ">=3.11"
        dependencies = {deps}
        """


def flit_pyproject(name: str, dependencies: list[str] | None = None) -> str:
    """A project on flit_core: a build backend a fraction of setuptools' cost, for
    tests about the bundler rather than about a particular backend."""
    deps = json.dumps(dependencies or [])
    return f"""
        [build-system]
        requires = ["flit_core>=3.9,<4"]
        build-backend = "flit_core.buildapi"

        [project]
        name = "{name}"
        version = "0.1.0"
        description = "a test project"
        requires-python = ">=3.11"
        dependencies = {deps}
        """


WORKFLOW_MODULE = """
    from harbor_exec.authoring import AgentWorkflow

    class Flow(AgentWorkflow):
        async def run(self, ctx):
            return [{"role": "assistant", "content": "1"}]
    """
# The grader in a module of its own (the workflow's never imports it): the bundle's
# agent part leaves it out.
GRADER_MODULE = """
    from harbor_exec.authoring import Grader

    class Judge(Grader):
        async def grade(self, ctx):
            ctx.set_reward(1.0)
    """


def write_rollout(
    path: Path,
    *,
    prompt: str,
    chat_url: str,
    label: str | None = None,
    rollout_id: str = "r-1",
    api_key: str | None = API_KEY,
    metadata: dict[str, Any] | None = None,
) -> None:
    payload: dict[str, Any] = {
        "version": 1,
        "rollout_id": rollout_id,
        "prompt": [{"role": "user", "content": prompt}],
        "metadata": metadata,
        "chat_completions_url": chat_url,
        "api_key": api_key,
    }
    if label is not None:
        payload["label"] = label
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload), encoding="utf-8")


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment minus anything that leaks packages or indexes in."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"} and not k.startswith("PIP_")
    }
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


def run_runner(
    command: str,
    *,
    manifest: Path,
    logs_dir: Path,
    tests_dir: Path,
    python: Path | str = sys.executable,
    pythonpath: list[Path] | None = None,
    cwd: Path | None = None,
    args: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """``python -m harbor_exec.container.runner <command> [args]`` as a real subprocess."""
    extra = {}
    if pythonpath is not None:
        extra["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    return subprocess.run(
        [
            str(python),
            "-m",
            "harbor_exec.container.runner",
            command,
            "--manifest",
            str(manifest),
            "--logs-dir",
            str(logs_dir),
            "--tests-dir",
            str(tests_dir),
            *args,
        ],
        env=clean_env(**extra),
        cwd=cwd or logs_dir.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
