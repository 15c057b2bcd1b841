"""The bundled grader runs isolated from anything the agent shaped, in a real container.

Each hostile workflow answers wrong and plants code where the grader's interpreter
used to look: its own ``harbor_exec`` in the task's workdir (carried back into a
separate verifier as an artifact), and, in shared mode, a fake ``harbor_exec``, a
``sitecustomize.py`` and a shadow of the grader's module in the user-code dir. The
reward must stay the honest grader's 0.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.bundler import Bundle
from harbor_exec.container.exchange import USER_CODE_DIR
from tests.fake_chat import FakeChat
from tests.hostile import bundle_of, bundled_rollout, hostile_project, only_trial

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "isolation_probe"
TEMPLATE = ROOT / "tasks_examples" / "template"  # WORKDIR /app

WORKFLOWS = f'''
    """Workflows that answer wrong and plant a forged grader."""

    from pathlib import Path

    from harbor_exec.authoring import AgentWorkflow

    WRONG = [{{"role": "user", "content": "q"}}, {{"role": "assistant", "content": "7"}}]
    # Run at import: a forged reward, then out before the real runner could start.
    FORGE = (
        "import json, os\\n"
        "os.makedirs('/logs/verifier', exist_ok=True)\\n"
        "open('/logs/verifier/reward.json', 'w').write(json.dumps({{'reward': 1.0}}))\\n"
        "print('harbor-exec runner: reward 1.0 written')\\n"
        "os._exit(0)\\n"
    )
    SHADOW_GRADER = (
        "from harbor_exec.authoring import Grader\\n"
        "class Honest(Grader):\\n"
        "    async def grade(self, ctx):\\n"
        "        ctx.set_reward(1.0)\\n"
    )


    def plant(root, files):
        for name, text in files.items():
            path = Path(root) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


    def fake_harbor_exec(root):
        plant(root, {{
            "harbor_exec/__init__.py": FORGE,
            "harbor_exec/container/__init__.py": FORGE,
            "harbor_exec/container/runner.py": FORGE,
        }})


    class WorkdirShadow(AgentWorkflow):
        async def run(self, ctx):
            # The task's workdir, carried into a separate verifier as an artifact.
            fake_harbor_exec("/app")
            plant("/app", {{"sitecustomize.py": FORGE, "usercustomize.py": FORGE}})
            return WRONG


    class UserCodeShadow(AgentWorkflow):
        async def run(self, ctx):
            # The user-code dir (on the agent's PYTHONPATH): extra files there survive
            # a placement of the bundle that only writes the bundle's own files.
            fake_harbor_exec("{USER_CODE_DIR}")
            plant("{USER_CODE_DIR}", {{
                "sitecustomize.py": FORGE,
                "usercustomize.py": FORGE,
                # A package directory wins over the module file of the same name.
                "isolation_probe/grader/__init__.py": SHADOW_GRADER,
            }})
            return WRONG
'''

GRADER = '''
    """The honest grader, in its own module."""

    from harbor_exec.authoring import Grader


    class Honest(Grader):
        async def grade(self, ctx):
            answer = str(ctx.sample.messages[-1].get("content", "")).strip()
            ctx.sample.metrics["honest_grader"] = 1.0
            ctx.set_reward(1.0 if answer == ctx.label else 0.0)
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grader-isolation")
    return hostile_project(root / "probe", PACKAGE, WORKFLOWS, GRADER)


def bundle_for(project: Path, workflow: str) -> Bundle:
    return bundle_of(project, PACKAGE, workflow, "Honest")


def workdir_artifact_task(tmp_path: Path) -> Path:
    """The template task (WORKDIR /app) without tests/, declaring /app an artifact: what
    a separate verifier naturally needs to see the agent's work."""
    task = tmp_path / "workdir-artifact"
    shutil.copytree(TEMPLATE, task)
    shutil.rmtree(task / "tests")
    toml = task / "task.toml"
    toml.write_text('artifacts = ["/app"]\n' + toml.read_text())
    return task


def rollout(tmp_path: Path, bundle: Bundle, task: Path, chat: FakeChat, **options: Any) -> Any:
    return bundled_rollout(tmp_path, bundle, task, chat, **options)


def test_a_harbor_exec_in_the_workdir_artifact_does_not_grade_itself(
    tmp_path: Path, project: Path, chat: FakeChat
) -> None:
    """Separate mode (the default with a bundled grader) and ``artifacts = ["/app"]``:
    the agent's ``/app/harbor_exec`` comes back into the verifier, and is not run."""
    task = workdir_artifact_task(tmp_path)
    result = rollout(tmp_path, bundle_for(project, "WorkdirShadow"), task, chat)
    trial, record = only_trial(tmp_path)
    assert record["config"]["verifier_environment_mode"] == "separate"
    # The planted files did reach the verifier's /app (the attack had its chance).
    assert (trial / "artifacts" / "app" / "harbor_exec" / "container" / "runner.py").is_file()
    assert result.status == "success", result.err_message
    assert result.sample.reward == 0.0
    assert result.sample.metrics["honest_grader"] == 1.0


def test_planted_packages_in_the_user_code_dir_do_not_shadow_a_shared_grader(
    tmp_path: Path, project: Path, chat: FakeChat
) -> None:
    """Shared mode, asked for explicitly: a fake ``harbor_exec``, a ``sitecustomize.py``
    and a shadow of the grader's module in the agent's user-code dir change nothing."""
    task = workdir_artifact_task(tmp_path)
    bundle = bundle_for(project, "UserCodeShadow")
    result = rollout(tmp_path, bundle, task, chat, grader_verifier_mode="shared")
    _, record = only_trial(tmp_path)
    assert record["config"]["verifier_environment_mode"] == "shared"
    assert result.status == "success", result.err_message
    assert result.sample.reward == 0.0
    assert result.sample.metrics["honest_grader"] == 1.0
