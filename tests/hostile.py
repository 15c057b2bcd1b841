"""Hostile workflow projects and their rollouts through HarborBackend and the real server.

The attack tests write a project whose ``workflow.py`` holds workflows that attack and
whose ``grader.py`` holds an honest grader (a module of its own: the agent's container
never gets it), bundle one workflow of it, and run one rollout against a task on the
real engine.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import httpx

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler import Bundle, build_bundle
from harbor_exec.client import RolloutClient
from harbor_exec.server.app import create_rollout_server
from tests.bundle_utils import setuptools_pyproject, write_project
from tests.fake_chat import FakeChat
from tests.server_utils import serve


def hostile_project(root: Path, package: str, workflows: str, grader: str, **modules: str) -> Path:
    """A project at ``root`` whose package ``package`` holds ``workflow.py`` = ``workflows``,
    ``grader.py`` = ``grader`` and ``<name>.py`` for each of ``modules``."""
    files = {
        "pyproject.toml": setuptools_pyproject(package.replace("_", "-")),
        f"src/{package}/__init__.py": "",
        f"src/{package}/workflow.py": workflows,
        f"src/{package}/grader.py": grader,
    }
    files.update({f"src/{package}/{name}.py": text for name, text in modules.items()})
    return write_project(root, files)


def bundle_of(
    project: Path, package: str, workflow: str, grader: str, grader_config: str | None = None
) -> Bundle:
    """The bundle of ``package.workflow:<workflow>`` with ``package.grader:<grader>`` (and
    ``grader_config``, a full ``module:attr`` ref, when given)."""
    return build_bundle(
        project,
        workflow=f"{package}.workflow:{workflow}",
        grader=f"{package}.grader:{grader}",
        grader_config=grader_config,
        cache_dir=project.parent / "cache",
    )


def bundled_rollout(
    tmp_path: Path,
    bundle: Bundle,
    tasks_dir: Path,
    chat: FakeChat,
    *,
    api_key: str | None = None,
    timeout_sec: float = 180.0,
    **options: Any,
) -> Any:
    """One rollout (label "42") of ``bundle`` on ``tasks_dir``; its trial stays in
    ``tmp_path / "trials"``."""
    assert bundle.manifest.workflow is not None
    backend = HarborBackend(
        tasks_dir=tasks_dir,
        agent=bundle.manifest.workflow,
        grader=bundle.manifest.grader,
        bundle=bundle,
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        cleanup_successful_trials=False,
        **options,
    )
    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")

    async def one(url: str) -> Any:
        async with httpx.AsyncClient(timeout=timeout_sec) as http:
            return await RolloutClient(url=url, http_client=http).run_rollout(
                initial_messages=[{"role": "user", "content": "q"}],
                chat_completions_url=chat.base_url,
                rollout_id=uuid.uuid4().hex,
                llm_api_key=api_key or "sk-test-" + uuid.uuid4().hex,
                label="42",
            )

    with serve(app) as url:
        return asyncio.run(one(url))


def only_trial(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """The one trial directory under ``tmp_path / "trials"`` and its result.json."""
    (trial,) = [p for p in (tmp_path / "trials").iterdir() if p.is_dir()]
    return trial, json.loads((trial / "result.json").read_text())
