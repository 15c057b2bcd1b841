"""A bundle's two parts: the agent's container never gets the grader or its config.

The bundler refuses, before anything is built, a project whose grader (or grader
config) is in a module the workflow's side imports; a project that splits builds,
and ``prepare_bundle`` gives the agent a manifest without grader refs and the wheel
without the grader's modules, and the verifier side everything. (The attack, in real
containers: ``tests/test_grader_isolation.py``.)
"""

# Fixtures imported from bundle_utils are parameters of the same name here.
# ruff: noqa: F811

from __future__ import annotations

import json
import logging
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from harbor_exec.agents.workflow import WorkflowAgent
from harbor_exec.authoring import RolloutContext
from harbor_exec.backends.harbor.planner import TrialPlanner, prepare_bundle
from harbor_exec.backends.harbor.resolver import ResolvedTask
from harbor_exec.bundler import Bundle, GraderSplitError, Manifest, build_bundle
from harbor_exec.bundler.project import load_project
from harbor_exec.bundler.split import split_bundle
from harbor_exec.container.exchange import MANIFEST_PATH, USER_CODE_DIR
from harbor_exec.executors.spec import trial_request
from harbor_exec.protocol import ExecutionRequest
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.policy import SandboxPolicy
from tests.bundle_utils import (  # noqa: F401  (fixtures are used by name)
    EXAMPLE_REFS,
    GRADER_MODULE,
    WORKFLOW_MODULE,
    bundle_cache,
    example_bundle,
    flit_pyproject,
    write_project,
)
from tests.task_factory import make_task

PKG = "split_flow"
FLOW, JUDGE = textwrap.dedent(WORKFLOW_MODULE), textwrap.dedent(GRADER_MODULE)
SECRET = "rubric-secret-7d1f0c"
GRADER_CONFIG = f"""
    from harbor_exec.authoring import GraderConfig

    class JudgeConfig(GraderConfig):
        judge_key: str = ""

    judge_config = JudgeConfig(name="judge", judge_key={SECRET!r})
    """


def project(root: Path, **modules: str) -> Path:
    """``split_flow`` with ``flow.py`` (the workflow), ``judge.py`` (the grader),
    ``secret.py`` (its config) and ``modules`` (``{"name": source}``, ``name`` may be
    ``"__init__"`` or ``"sub/__init__"``) replacing or adding modules."""
    files = {
        "pyproject.toml": flit_pyproject(PKG.replace("_", "-"), ["httpx>=0.27"]),
        f"{PKG}/__init__.py": "",
        f"{PKG}/flow.py": WORKFLOW_MODULE,
        f"{PKG}/judge.py": GRADER_MODULE,
        f"{PKG}/secret.py": GRADER_CONFIG,
    }
    files.update({f"{PKG}/{name}.py": text for name, text in modules.items()})
    return write_project(root, files)


REFS: dict[str, Any] = {
    "workflow": f"{PKG}.flow:Flow",
    "grader": f"{PKG}.judge:Judge",
    "grader_config": f"{PKG}.secret:judge_config",
}


def refused(root: Path, **refs: str | None) -> str:
    """The message of the GraderSplitError ``build_bundle`` raises with strict grader
    isolation, before any build."""
    with pytest.raises(GraderSplitError) as info:
        build_bundle(
            root, cache_dir=root.parent / "cache", strict_grader_isolation=True, **{**REFS, **refs}
        )
    assert not (root.parent / "cache").exists()  # refused before anything was built
    message = str(info.value)
    # The fix: a module of their own, which the workflow's side does not import.
    assert "Put them in their own module" in message
    assert "that the workflow and its config do not import" in message
    return message


# --------------------------------------------------------------------------- refused


def test_a_grader_in_the_workflows_module_is_refused(tmp_path: Path) -> None:
    flow = """
        from harbor_exec.authoring import AgentWorkflow, Grader

        class Flow(AgentWorkflow):
            async def run(self, ctx):
                return [{"role": "assistant", "content": "1"}]

        class Judge(Grader):
            async def grade(self, ctx):
                ctx.set_reward(1.0)
        """
    message = refused(project(tmp_path / "p", flow=flow), grader=f"{PKG}.flow:Judge")
    # It names the grader ref, its module, and the workflow ref that puts it on the agent side.
    assert f"grader ref '{PKG}.flow:Judge' is in module '{PKG}.flow'" in message
    assert f"the workflow ref '{PKG}.flow:Flow'" in message


def test_a_grader_config_beside_the_workflow_config_is_refused(tmp_path: Path) -> None:
    root = project(
        tmp_path / "p", settings=textwrap.dedent(GRADER_CONFIG) + "\nflow_config = None\n"
    )
    message = refused(
        root,
        workflow_config=f"{PKG}.settings:flow_config",
        grader_config=f"{PKG}.settings:judge_config",
    )
    assert (
        f"grader_config ref '{PKG}.settings:judge_config' is in module '{PKG}.settings'" in message
    )
    assert f"the workflow_config ref '{PKG}.settings:flow_config'" in message
    assert "grader ref" not in message  # the grader itself is in a module of its own


@pytest.mark.parametrize(
    "statement",
    [
        f"from {PKG}.judge import Judge",
        f"import {PKG}.judge",
        f"from {PKG} import judge",
        "from . import judge",
        "from .judge import Judge",
        "def later():\n    from .judge import Judge",  # a function body runs too
    ],
)
def test_a_workflow_that_imports_the_graders_module_is_refused(
    tmp_path: Path, statement: str
) -> None:
    root = project(tmp_path / "p", flow=f"{statement}\n" + FLOW)
    message = refused(root)
    assert f"grader ref '{PKG}.judge:Judge' is in module '{PKG}.judge'" in message
    assert (
        f"{PKG}.flow (the module of the workflow ref '{PKG}.flow:Flow') imports {PKG}.judge"
        in message
    )


def test_imports_through_other_modules_and_packages_are_followed(tmp_path: Path) -> None:
    # flow -> helpers (relative) -> tools/__init__ (from .. import) -> secret: the config.
    root = project(
        tmp_path / "p",
        flow="from .helpers import shout\n" + FLOW,
        helpers="from .tools import LOUD\n\ndef shout(text):\n    return text + LOUD\n",
        **{"tools/__init__": "from .. import secret\nLOUD = '!'\n"},
    )
    message = refused(root)
    assert f"grader_config ref '{PKG}.secret:judge_config' is in module '{PKG}.secret'" in message
    assert (
        f"{PKG}.flow (the module of the workflow ref '{PKG}.flow:Flow') imports "
        f"{PKG}.helpers, which imports {PKG}.tools, which imports {PKG}.secret"
    ) in message
    # The package __init__ of the workflow's module runs on every import of it.
    root = project(tmp_path / "q", __init__="from .judge import Judge\n")
    assert f"{PKG} (a package of {PKG}.flow, the workflow ref's module) imports {PKG}.judge" in (
        refused(root)
    )


def test_a_grader_that_imports_the_workflow_splits(tmp_path: Path) -> None:
    """The grader's module may import the workflow's; a TYPE_CHECKING import of the
    grader's in the workflow is never run, so it does not count."""
    root = project(
        tmp_path / "p",
        flow=(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .judge import Judge\n"
            + FLOW
        ),
        judge=f"from {PKG}.flow import Flow\nfrom .secret import judge_config\n" + JUDGE,
    )
    assert split_bundle(load_project(root), REFS) == [f"{PKG}/judge.py", f"{PKG}/secret.py"]
    # A grader package: the whole directory is the grader's (each submodule runs its __init__).
    root = project(
        tmp_path / "q", **{"grading/__init__": GRADER_MODULE, "grading/rubric": "POINTS = 3\n"}
    )
    refs = {**REFS, "grader": f"{PKG}.grading:Judge"}
    assert split_bundle(load_project(root), refs) == [f"{PKG}/grading/", f"{PKG}/secret.py"]


def test_harbor_exec_bundle_strict_prints_the_refusal_and_exits_1(tmp_path: Path) -> None:
    from harbor_exec.cli.app import app

    root = project(tmp_path / "p", flow="from .judge import Judge\n" + FLOW)
    result = CliRunner().invoke(
        app,
        ["bundle", str(root), "--workflow", REFS["workflow"], "--grader", REFS["grader"],
         "--cache-dir", str(tmp_path / "c"), "--strict-grader-isolation"],
        terminal_width=400,
    )  # fmt: skip
    assert result.exit_code == 1
    output = " ".join(result.output.split())
    assert "the grader cannot be kept out of the agent's container" in output
    assert f"grader ref '{PKG}.judge:Judge' is in module '{PKG}.judge'" in output


# --------------------------------------------------------------------------- built


#: osmosis-ai's usual layout: the workflow, the grader and the grader's config in one module.
ONE_MODULE = f"""
from harbor_exec.authoring import AgentWorkflow, Grader, GraderConfig


class Flow(AgentWorkflow):
    async def run(self, ctx):
        return [{{"role": "assistant", "content": "1"}}]


class Judge(Grader):
    async def grade(self, ctx):
        ctx.set_reward(1.0)


class JudgeConfig(GraderConfig):
    judge_key: str = ""


judge_config = JudgeConfig(name="judge", judge_key={SECRET!r})
"""


def test_a_project_in_one_module_builds_and_says_once_what_the_agent_can_read(
    tmp_path: Path, bundle_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As osmosis-ai's docs write it (one module, or a package ``__init__``): it builds,
    the grader's part is the whole bundle and the agent's part holds that module too,
    and bundling says so once, by name, with the way to split it."""
    root = project(tmp_path / "p", flow=ONE_MODULE)
    refs: dict[str, Any] = {
        "workflow": f"{PKG}.flow:Flow",
        "grader": f"{PKG}.flow:Judge",
        "grader_config": f"{PKG}.flow:judge_config",
    }
    with caplog.at_level(logging.WARNING, logger="harbor_exec.bundler"):
        bundle = build_bundle(root, cache_dir=bundle_cache, **refs)
        assert build_bundle(root, cache_dir=bundle_cache, **refs).cached
    said = [
        r.getMessage() for r in caplog.records if "can read the grader's source" in r.getMessage()
    ]
    assert len(said) == 1, said
    assert f"grader ref '{PKG}.flow:Judge' is in module '{PKG}.flow'" in said[0]
    assert f"grader_config ref '{PKG}.flow:judge_config'" in said[0]
    assert "own module" in said[0] and "--strict-grader-isolation" in said[0]
    assert bundle.manifest.grader_exposed and bundle.manifest.grader_only == []
    assert split_bundle_lenient(root, refs).exposed
    prepared = prepare_bundle(refs["workflow"], bundle=bundle)
    assert prepared.has_grader
    agent, grader = _paths(prepared.agent_files), _paths(prepared.grader_files)  # type: ignore[arg-type]
    assert f"{USER_CODE_DIR}/{PKG}/flow.py" in agent and agent == grader
    agent_manifest = json.loads(
        next(e.data for e in prepared.agent_files if e.path == MANIFEST_PATH) or b""
    )
    assert agent_manifest["grader"] is None and agent_manifest["grader_exposed"] is False
    # Strict: refused by name, before any build.
    with pytest.raises(GraderSplitError, match="Put them in their own module"):
        build_bundle(root, cache_dir=tmp_path / "strict", strict_grader_isolation=True, **refs)
    assert not (tmp_path / "strict").exists()
    with pytest.raises(ValueError, match="strict_grader_isolation"):
        prepare_bundle(refs["workflow"], bundle=bundle, strict_grader_isolation=True)
    # The same in a package __init__ (the workflow's package runs it).
    root = project(tmp_path / "q", __init__=ONE_MODULE, flow="")
    refs = {k: v.replace(".flow:", ":") for k, v in refs.items()}
    assert split_bundle_lenient(root, refs).exposed


def split_bundle_lenient(root: Path, refs: dict[str, Any]) -> Any:
    from harbor_exec.bundler.split import grader_split

    return grader_split(load_project(root), refs)


def _paths(entries: list[object]) -> set[str]:
    return {e.path for e in entries}  # type: ignore[attr-defined]


def test_a_split_project_builds_and_its_agent_part_lacks_the_grader(
    tmp_path: Path, bundle_cache: Path
) -> None:
    root = project(tmp_path / "p", **{"grading/__init__": "", "grading/rubric": "POINTS = 3\n"})
    refs = {**REFS, "grader_config": f"{PKG}.grading.rubric:POINTS"}
    bundle = build_bundle(root, cache_dir=bundle_cache, **refs)
    assert bundle.manifest.grader_only == [f"{PKG}/grading/rubric.py", f"{PKG}/judge.py"]
    assert Manifest.read(bundle.manifest_path) == bundle.manifest

    refs = {**REFS, "grader": f"{PKG}.grading:Judge"}
    root = project(tmp_path / "q", **{"grading/__init__": GRADER_MODULE, "grading/rubric": ""})
    bundle = build_bundle(root, cache_dir=bundle_cache, **refs)
    assert bundle.manifest.grader_only == [f"{PKG}/grading/", f"{PKG}/secret.py"]
    prepared = prepare_bundle(refs["workflow"], bundle=bundle)
    agent, grader = _paths(prepared.agent_files), _paths(prepared.grader_files)  # type: ignore[arg-type]
    code = f"{USER_CODE_DIR}/{PKG}"
    assert {f"{code}/__init__.py", f"{code}/flow.py", MANIFEST_PATH} <= agent
    for gone in ("grading/__init__.py", "grading/rubric.py", "secret.py"):
        assert f"{code}/{gone}" not in agent and f"{code}/{gone}" in grader
    assert grader - agent == {
        f"{code}/grading/__init__.py",
        f"{code}/grading/rubric.py",
        f"{code}/secret.py",
    }
    assert not any(SECRET.encode() in (e.data or b"") for e in prepared.agent_files)

    manifests = {
        part: json.loads(next(e.data for e in files if e.path == MANIFEST_PATH) or b"")
        for part, files in (("agent", prepared.agent_files), ("grader", prepared.grader_files))
    }
    assert manifests["agent"]["grader"] is None and manifests["agent"]["grader_config"] is None
    assert manifests["agent"]["grader_only"] == []
    assert manifests["agent"]["workflow"] == refs["workflow"]
    assert manifests["grader"] == json.loads(bundle.manifest_path.read_bytes())
    # Everything else is the bundle's manifest as built.
    drop = ("grader", "grader_config", "grader_only")
    assert {k: v for k, v in manifests["agent"].items() if k not in drop} == {
        k: v for k, v in manifests["grader"].items() if k not in drop
    }
    assert prepared.key != prepared.grader_key and bundle.digest in prepared.key


def test_the_example_splits_and_its_trials_carry_both_parts(
    tmp_path: Path, example_bundle: Bundle
) -> None:
    """The planner names both parts by key; the grader's travels only to trials its
    grader verifies, and only the verifier side gets it."""
    assert example_bundle.manifest.grader_only == ["arith_agent/grader.py"]
    prepared = prepare_bundle(EXAMPLE_REFS["workflow"], bundle=example_bundle)
    planner = TrialPlanner(bundle=prepared, policy=SandboxPolicy(), trials_dir=tmp_path / "trials")
    with_tests = load_task(make_task(tmp_path / "tasks", "with-tests"))
    shutil.rmtree(make_task(tmp_path / "tasks", "no-tests") / "tests")
    no_tests = load_task(tmp_path / "tasks" / "no-tests", require_tests=False)
    request = ExecutionRequest(id="r-1", prompt=[{"role": "user", "content": "q"}], label="4")
    context = RolloutContext(chat_completions_url="http://127.0.0.1:9/v1", api_key="k" * 12)

    graded = planner.plan(request, ResolvedTask("no-tests", no_tests), context)
    assert graded.trial.verifier == "grader"
    assert (graded.trial.bundle, graded.trial.grader_bundle) == (prepared.key, prepared.grader_key)
    assert graded.content.bundle_files == prepared.agent_files
    assert graded.content.grader_files == prepared.grader_files
    trial = trial_request(graded.trial, graded.secrets, graded.content)
    assert isinstance(trial.agent, WorkflowAgent)
    agent_paths = {e.path for e in trial.agent.files(no_tests)}
    assert f"{USER_CODE_DIR}/arith_agent/workflow.py" in agent_paths
    assert f"{USER_CODE_DIR}/arith_agent/grader.py" not in agent_paths
    assert trial.verifier is not None
    verifier_paths = {e.path for e in trial.verifier.generated}
    assert "/opt/harbor-exec/grader/code/arith_agent/grader.py" in verifier_paths

    tested = planner.plan(request, ResolvedTask("with-tests", with_tests), context)
    assert tested.trial.verifier == "tests" and tested.trial.grader_bundle is None
    # Preferred, the grader verifies the task with tests of its own too.
    preferring = TrialPlanner(
        bundle=prepared,
        policy=SandboxPolicy(),
        trials_dir=tmp_path / "trials",
        prefer_grader=True,
    )
    preferred = preferring.plan(request, ResolvedTask("with-tests", with_tests), context)
    assert preferred.trial.verifier == "grader"
    assert preferred.trial.grader_bundle == prepared.grader_key


def test_start_says_which_tasks_their_own_tests_verify_instead_of_the_grader(
    tmp_path: Path, example_bundle: Bundle, caplog: pytest.LogCaptureFixture
) -> None:
    """A grader given for tasks that have tests/test.sh (the README's own example): the
    tests verify, as in Harbor, and start() says so, naming them and prefer_grader."""
    from harbor_exec.backends.harbor.backend import HarborBackend
    from tests.fake_runtime import FakeRuntime

    dataset = tmp_path / "dataset"
    make_task(dataset, "with-tests")
    shutil.rmtree(make_task(dataset, "no-tests") / "tests")
    for prefer, said in ((False, 1), (True, 0)):
        caplog.clear()
        backend = HarborBackend(
            tasks_dir=dataset,
            task_mode="dataset",
            agent=EXAMPLE_REFS["workflow"],
            grader=EXAMPLE_REFS["grader"],
            bundle=example_bundle,
            runtime=FakeRuntime(),
            trials_dir=tmp_path / "trials",
            prefer_grader=prefer,
        )
        with caplog.at_level(logging.WARNING, logger="harbor_exec.backends.harbor.backend"):
            backend.start()
        warned = [r.getMessage() for r in caplog.records if "does not verify" in r.getMessage()]
        assert len(warned) == said, warned
        if said:
            assert "1 task(s)" in warned[0] and "(with-tests)" in warned[0]
            assert "--prefer-grader" in warned[0]
