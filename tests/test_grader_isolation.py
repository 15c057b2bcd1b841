"""The bundled grader runs isolated from anything the agent shaped, in a real container.

Each hostile workflow answers wrong and plants code where the grader's interpreter
used to look: its own ``harbor_exec`` in the task's workdir (carried back into a
separate verifier as an artifact), and, in shared mode, a fake ``harbor_exec``, a
``sitecustomize.py`` and a shadow of the grader's module in the user-code dir. The
reward must stay the honest grader's 0.

And the grader's code and config never enter the agent's container: a workflow that
looks for them (imports, the manifest's grader refs, a secret of the grader's config
anywhere under ``/opt/harbor-exec``) finds nothing, while the grader gets its config.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.bundler import Bundle
from harbor_exec.container.exchange import USER_CODE_DIR
from tests.fake_chat import FakeChat
from tests.hostile import bundle_of, bundled_rollout, hostile_project, only_trial

# engine_lane("b"): its own tasks and bundles; no engine-wide counts, no wall-clock bound.
pytestmark = [
    pytest.mark.docker,
    pytest.mark.engine_lane("b"),
    pytest.mark.usefixtures("base_images"),
]

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

# A judge's key, say: only in the grader config's module. The workflow's source holds
# it reversed (so that its own file does not mention it), the grader's only its digest.
SECRET = "judge-key-" + uuid.uuid4().hex
SECRET_DIGEST = hashlib.sha256(SECRET.encode()).hexdigest()

SNOOP = '''

    import importlib
    import json
    import os

    from harbor_exec.authoring import AgentWorkflowOutput

    # Reversed at run time: a constant expression would be folded into the bytecode.
    NEEDLE = "".join(reversed("@REVERSED@")).encode()
    LOOKED_IN = ["/opt/harbor-exec", "/opt/harbor-exec-deps", "/logs", "/tmp"]


    def scan():
        """Every regular file under LOOKED_IN that holds the needle, and how many were read."""
        hits, read = [], 0
        for root in LOOKED_IN:
            for directory, _, names in os.walk(root):
                for name in names:
                    path = os.path.join(directory, name)
                    if os.path.islink(path) or not os.path.isfile(path):
                        continue
                    try:
                        with open(path, "rb") as handle:
                            data = handle.read()
                    except OSError:
                        continue
                    read += 1
                    if NEEDLE in data:
                        hits.append(path)
        return hits, read


    class Snoop(AgentWorkflow):
        """Looks for the grader and its config; answers right, and reports what it found."""

        async def run(self, ctx):
            report = {"imports": {}}
            for module in ("isolation_probe.grader_settings", "isolation_probe.grader"):
                try:
                    loaded = importlib.import_module(module)
                    report["imports"][module] = sorted(vars(loaded))
                except ImportError as exc:
                    report["imports"][module] = type(exc).__name__
            with open("/opt/harbor-exec/manifest.json") as handle:
                text = handle.read()
            manifest = json.loads(text)
            report["manifest"] = {
                key: manifest.get(key) for key in ("workflow", "grader", "grader_config", "grader_only")
            }
            report["manifest_names_grader_modules"] = any(
                name in text for name in ("isolation_probe.grader", "isolation_probe/grader")
            )
            report["hits"], report["read"] = scan()
            code = "/opt/harbor-exec/user/isolation_probe"
            report["user_code"] = sorted(n for n in os.listdir(code) if n.endswith(".py"))
            metrics = {"secret_hits": float(len(report["hits"]))}
            return AgentWorkflowOutput(
                messages=[
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": json.dumps(report)},
                    {"role": "assistant", "content": "42"},
                ],
                metrics=metrics,
            )
'''.replace("@REVERSED@", SECRET[::-1])

WORKFLOWS += SNOOP

GRADER = f'''
    """The honest grader, in its own module; it reports whether it got its config."""

    import hashlib

    from harbor_exec.authoring import Grader


    class Honest(Grader):
        async def grade(self, ctx):
            answer = str(ctx.sample.messages[-1].get("content", "")).strip()
            ctx.sample.metrics["honest_grader"] = 1.0
            key = getattr(self.config, "judge_key", None)
            if key is not None:
                digest = hashlib.sha256(key.encode()).hexdigest()
                ctx.sample.metrics["grader_config_ok"] = float(digest == "{SECRET_DIGEST}")
            ctx.set_reward(1.0 if answer == ctx.label else 0.0)
'''

# The grader's config, in a module of its own that nothing on the workflow's side imports.
GRADER_SETTINGS = f'''
    from harbor_exec.authoring import GraderConfig


    class JudgeConfig(GraderConfig):
        judge_key: str = ""


    grader_config = JudgeConfig(name="judge", judge_key="{SECRET}")
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grader-isolation")
    return hostile_project(
        root / "probe", PACKAGE, WORKFLOWS, GRADER, grader_settings=GRADER_SETTINGS
    )


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


@pytest.mark.parametrize("mode", ["separate", "shared"])
def test_the_agents_container_holds_neither_the_grader_nor_its_config(
    tmp_path: Path, project: Path, chat: FakeChat, mode: str
) -> None:
    """The agent's part of the bundle: no grader modules, a manifest without grader refs,
    no trace of the grader config's secret; the grader still gets its config, in both
    verifier modes."""
    bundle = bundle_of(
        project,
        PACKAGE,
        "Snoop",
        "Honest",
        grader_config=f"{PACKAGE}.grader_settings:grader_config",
    )
    assert bundle.manifest.grader_only == [f"{PACKAGE}/grader.py", f"{PACKAGE}/grader_settings.py"]
    task = tmp_path / "grader-template"
    shutil.copytree(TEMPLATE, task)
    shutil.rmtree(task / "tests")
    result = rollout(tmp_path, bundle, task, chat, grader_verifier_mode=mode)
    _, record = only_trial(tmp_path)
    assert record["config"]["verifier_environment_mode"] == mode
    assert result.status == "success", result.err_message
    report = json.loads(result.sample.messages[-2]["content"])
    # Neither module imports: their files are not in the agent's container.
    assert report["imports"] == {
        f"{PACKAGE}.grader_settings": "ModuleNotFoundError",
        f"{PACKAGE}.grader": "ModuleNotFoundError",
    }
    assert report["user_code"] == ["__init__.py", "workflow.py"]
    assert report["manifest"] == {
        "workflow": f"{PACKAGE}.workflow:Snoop",
        "grader": None,
        "grader_config": None,
        "grader_only": [],
    }
    assert report["manifest_names_grader_modules"] is False
    # Nothing it could read mentions the secret (and it did read: the dependency
    # environment, its own code).
    assert report["hits"] == [] and result.sample.metrics["secret_hits"] == 0.0
    assert report["read"] > 100
    # The grader got its config and graded honestly (the answer is right).
    assert result.sample.metrics["grader_config_ok"] == 1.0
    assert result.sample.metrics["honest_grader"] == 1.0
    assert result.sample.reward == 1.0
