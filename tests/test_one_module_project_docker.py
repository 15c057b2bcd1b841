"""A project laid out as osmosis-ai's docs write one runs unchanged (real Docker).

``tasks_examples/osmosis_one_module_project``: the workflow, the grader and both
configs in one module (``one_arith/main.py``), and the same in a package
``__init__.py``. Each runs through osmosis-ai 0.3.8's own LocalBackend (the
reference), ours, and HarborBackend behind the rollout server with the grader in a
separate verifier container (the default) and in the agent's (shared): the same status,
category and reward on every case. Strict grader isolation refuses it, by name.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.backends.local import LocalBackend
from harbor_exec.bundler import build_bundle
from harbor_exec.server import create_rollout_server
from tests.bundle_utils import REPO_ROOT, bundle_cache
from tests.fake_chat import FakeChat
from tests.osmosis_side_by_side import run_osmosis_rollout, template_without_tests
from tests.server_utils import serve

# engine_lane: its own project, tasks and backends; no timing bounds.
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

__all__ = ["bundle_cache"]  # the session fixture, used below

PROJECT = REPO_ROOT / "tasks_examples" / "osmosis_one_module_project"
PROMPT = [{"role": "user", "content": "What is 6 * 7?"}]
#: (label, metadata): the model answers 42 (FakeChat's default).
CASES: dict[str, tuple[str, dict[str, Any] | None]] = {
    "right": ("42", None),
    "wrong": ("41", None),
    "raises": ("42", {"raise": "the agent broke"}),
}


def _layout(kind: str, root: Path) -> tuple[Path, dict[str, Any]]:
    """The project as written (``module``: ``one_arith/main.py``), or everything moved
    into the package's ``__init__.py`` (``init``, package ``one_arith_init``)."""
    if kind == "module":
        module = "one_arith.main"
        return PROJECT, {
            "workflow": f"{module}:ArithWorkflow",
            "workflow_config": f"{module}:workflow_config",
            "grader": f"{module}:ArithGrader",
            "grader_config": f"{module}:grader_config",
        }
    project = root / "init-project"
    shutil.copytree(PROJECT, project, ignore=shutil.ignore_patterns("__pycache__"))
    package = project / "src" / "one_arith_init"
    (project / "src" / "one_arith").rename(package)
    (package / "__init__.py").write_text((package / "main.py").read_text())
    (package / "main.py").unlink()
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"one-arith"', '"one-arith-init"'))
    return project, {
        "workflow": "one_arith_init:ArithWorkflow",
        "workflow_config": "one_arith_init:workflow_config",
        "grader": "one_arith_init:ArithGrader",
        "grader_config": "one_arith_init:grader_config",
    }


@pytest.fixture
def on_path() -> Iterator[list[str]]:
    """Source dirs put on ``sys.path`` for the in-process backends, taken off after."""
    added: list[str] = []
    yield added
    for entry in added:
        sys.path.remove(entry)


def _outcomes(url: str, chat: FakeChat) -> dict[str, tuple[str, str | None, float | None]]:
    """(status, category, reward) of every case through osmosis-ai's client."""

    async def run_all() -> dict[str, tuple[str, str | None, float | None]]:
        found = {}
        for case, (label, metadata) in CASES.items():
            result = await run_osmosis_rollout(
                url,
                chat.base_url,
                uuid.uuid4().hex,
                PROMPT,
                llm_api_key="sk-one-module",
                label=label,
                metadata=metadata,
                timeout_sec=120,
            )
            category = result.err_category.value if result.err_category else None
            reward = result.sample.reward if result.sample is not None else None
            found[case] = (result.status.value, category, reward)
        return found

    return asyncio.run(run_all())


@pytest.mark.parametrize("layout", ["module", "init"])
def test_a_one_module_project_runs_as_osmosis_ai_runs_it(
    layout: str,
    tmp_path: Path,
    chat: FakeChat,
    bundle_cache: Path,
    on_path: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from osmosis_ai.rollout import LocalBackend as OsmosisLocalBackend
    from osmosis_ai.rollout.server import create_rollout_server as create_osmosis_server

    chat.reset()
    project, refs = _layout(layout, tmp_path)
    on_path.append(str(project / "src"))
    sys.path.insert(0, on_path[-1])
    monkeypatch.setenv("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", str(tmp_path / "osmosis-root"))
    reference_app = create_osmosis_server(
        backend=OsmosisLocalBackend(**refs), configure_logging=False
    )
    with serve(reference_app) as url:
        reference = _outcomes(url, chat)
    assert reference == {
        "right": ("success", None, 1.0),
        "wrong": ("success", None, 0.0),
        "raises": ("failure", "agent_error", None),
    }
    local = LocalBackend(**refs, artifact_root=tmp_path / "local-root")
    with serve(create_rollout_server(backend=local, artifact_root=tmp_path / "local-root")) as url:
        assert _outcomes(url, chat) == reference

    bundle = build_bundle(project, cache_dir=bundle_cache, **refs)
    assert bundle.manifest.grader_exposed and bundle.manifest.grader_only == []
    tasks = template_without_tests(tmp_path)
    for mode in ("separate", "shared"):
        backend = HarborBackend(
            tasks_dir=tasks,
            agent=refs["workflow"],
            grader=refs["grader"],
            bundle=bundle,
            grader_verifier_mode=mode,
            trials_dir=tmp_path / f"trials-{mode}",
            artifacts_dir=tmp_path / f"artifacts-{mode}",
        )
        app = create_rollout_server(backend=backend, artifact_root=tmp_path / f"served-{mode}")
        with serve(app) as url:
            assert _outcomes(url, chat) == reference, mode


def test_strict_grader_isolation_refuses_it_by_name(tmp_path: Path) -> None:
    from harbor_exec.cli.app import app

    result = CliRunner().invoke(
        app,
        ["serve", "--tasks-dir", str(template_without_tests(tmp_path)),
         "--agent", "one_arith.main:ArithWorkflow", "--grader", "one_arith.main:ArithGrader",
         "--code-dir", str(PROJECT), "--strict-grader-isolation"],
        terminal_width=400,
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    output = " ".join(result.output.split())
    assert "grader ref 'one_arith.main:ArithGrader' is in module 'one_arith.main'" in output
    assert "Put them in their own module" in output


#: A hostile workflow and an honest grader in one module: the workflow looks for the
#: judge's key everywhere it can read; the grader needs it (its digest is the label,
#: which only the grader gets) and rewards an answer that found nothing.
PEEKING = """
import hashlib
import os

from harbor_exec.authoring import AgentWorkflow, Grader

# Built at run time: its own source (and .pyc) must not hold what it looks for.
NEEDLE = bytes([104, 120]) + b"-judge-"


def _found() -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if NEEDLE in open(f"/proc/{pid}/environ", "rb").read():
                    found.append(f"/proc/{pid}/environ")
            except OSError:
                pass
    for top in ("/opt", "/tmp", "/logs", "/app", "/root", "/etc", "/tests"):
        for root, _dirs, files in os.walk(top):
            for name in files:
                path = os.path.join(root, name)
                try:
                    if NEEDLE in open(path, "rb").read(1 << 20):
                        found.append(path)
                except OSError:
                    pass
    return found


class Peek(AgentWorkflow):
    async def run(self, ctx):
        found = _found()
        return [{"role": "assistant", "content": "found " + " ".join(found) if found else "clean"}]


class Judge(Grader):
    async def grade(self, ctx):
        key = os.environ.get("HX_JUDGE_KEY", "")
        right = hashlib.sha256(key.encode()).hexdigest() == ctx.label
        clean = ctx.sample is not None and ctx.sample.messages[-1]["content"] == "clean"
        ctx.set_reward(1.0 if key and right and clean else 0.0)
"""


def test_a_judge_key_reaches_only_the_grader_in_its_own_container(
    tmp_path: Path, chat: FakeChat, bundle_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grader_env: the server names a variable of its environment; only the grader's
    process in its separate verifier container gets it. A workflow in the same module
    that searches the agent's container for it finds nothing, the key is in no trial
    file, and the shared grader mode is refused with it."""
    from tests.bundle_utils import flit_pyproject, write_project

    key = "hx-judge-" + uuid.uuid4().hex
    monkeypatch.setenv("HX_JUDGE_KEY", key)
    project = write_project(
        tmp_path / "peek",
        {
            "pyproject.toml": flit_pyproject("peek-judge"),
            "peek_judge/__init__.py": "",
            "peek_judge/main.py": PEEKING,
        },
    )
    refs: dict[str, Any] = {"agent": "peek_judge.main:Peek", "grader": "peek_judge.main:Judge"}
    bundle = build_bundle(
        project, cache_dir=bundle_cache, workflow=refs["agent"], grader=refs["grader"]
    )
    tasks = template_without_tests(tmp_path)
    backend = HarborBackend(
        tasks_dir=tasks,
        bundle=bundle,
        grader_env=["HX_JUDGE_KEY"],
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        cleanup_successful_trials=False,
        **refs,
    )
    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "served")
    with serve(app) as url:

        async def one() -> Any:
            return await run_osmosis_rollout(
                url,
                chat.base_url,
                uuid.uuid4().hex,
                PROMPT,
                label=hashlib.sha256(key.encode()).hexdigest(),
                timeout_sec=120,
            )

        result = asyncio.run(one())
    assert result.status.value == "success", result.err_message
    assert result.sample.messages[-1]["content"] == "clean"
    assert result.sample.reward == 1.0  # the grader had the key
    for root in (tmp_path / "trials", tmp_path / "artifacts", tmp_path / "served"):
        leaked = [p for p in root.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
        assert leaked == [], leaked
    shared = HarborBackend(
        tasks_dir=tasks,
        bundle=bundle,
        grader_env=["HX_JUDGE_KEY"],
        grader_verifier_mode="shared",
        trials_dir=tmp_path / "trials-shared",
        **refs,
    )
    with pytest.raises(ValueError, match="separate verifier container"):
        shared.start()
