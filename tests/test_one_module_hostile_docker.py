"""The sandbox's hostile workflows, written as osmosis-ai users write projects: the
workflow and the honest grader in one module (real Docker).

One module (``hostile_one/main.py``) holds ``Attack``, a workflow that answers wrongly
("41"; the label is "42") and then attacks as the rollout's prompt says, and
``ExactMatch``, the honest grader. Its module is the workflow's, so the agent's
container holds the grader's source: the attacks aim at what that makes reachable.
Every rollout must end a success with the honest grader's 0.0, in the separate
verifier mode (the default) and in the shared one:

- ``workdir``: a fake ``harbor_exec`` and ``sitecustomize.py`` in the task's workdir,
  which a separate verifier gets back as an artifact (``artifacts = ["/app"]``);
- ``user-code``: the same on the agent's ``PYTHONPATH`` (the user-code dir), plus the
  grader's own module rewritten in place and shadowed by a package of the same name;
- ``rewrite``: a detached process rewrites ``sample.json`` after the runner wrote it;
- ``claims``: the workflow hands over its own sample with reward 1.0 and
  ``remove_sample``;
- ``flood``: the copy-back budget filled (a failure would have the zero dropped).

The judge key's attack in this layout is in tests/test_one_module_project_docker.py.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler import build_bundle
from harbor_exec.client import RolloutClient
from harbor_exec.server.app import create_rollout_server
from tests.bundle_utils import REPO_ROOT, flit_pyproject, write_project
from tests.fake_chat import FakeChat
from tests.server_utils import serve

# engine_lane: its own project, task and backends; no timing bounds.
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

MODULE = r'''
    """A workflow that answers wrongly and attacks, and the honest grader: one module."""

    import json
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from harbor_exec.authoring import (
        AgentWorkflow, Grader, RolloutSample, SampleSource, get_rollout_context,
    )

    WRONG = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "41"}]
    FORGED_ANSWER = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "42"}]
    HERE = Path(__file__).resolve()
    # Run at import: a forged reward, then out before the real runner could go on.
    FORGE = (
        "import json, os\n"
        "os.makedirs('/logs/verifier', exist_ok=True)\n"
        "open('/logs/verifier/reward.json', 'w').write(json.dumps({'reward': 1.0}))\n"
        "os._exit(0)\n"
    )
    # This module as the agent would have it: the grader gives 1.0 to anything.
    GENEROUS = (
        "from harbor_exec.authoring import AgentWorkflow, Grader\n"
        "class Attack(AgentWorkflow):\n"
        "    async def run(self, ctx):\n"
        "        return []\n"
        "class ExactMatch(Grader):\n"
        "    async def grade(self, ctx):\n"
        "        ctx.set_reward(1.0)\n"
    )
    REWRITER = (
        "import json, os, time\n"
        "from pathlib import Path\n"
        "sample = Path('/logs/agent/sample.json')\n"
        "Path('/tmp/rewriter-started').write_text('yes')\n"
        "deadline = time.monotonic() + 60\n"
        "while time.monotonic() < deadline:\n"
        "    try:\n"
        "        if '41' in sample.read_text():\n"
        "            forged = sample.with_name('.forged')\n"
        f"            forged.write_text({json.dumps({'messages': FORGED_ANSWER, 'reward': 1.0})!r})\n"
        "            os.replace(forged, sample)\n"
        "            Path('/logs/agent/rewritten.txt').write_text('rewritten')\n"
        "    except OSError:\n"
        "        pass\n"
        "    time.sleep(0.001)\n"
    )


    def plant(root, files):
        for name, text in files.items():
            path = Path(root) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


    def fake_harbor_exec(root):
        plant(root, {
            "harbor_exec/__init__.py": FORGE,
            "harbor_exec/container/__init__.py": FORGE,
            "harbor_exec/container/runner.py": FORGE,
            "sitecustomize.py": FORGE,
            "usercustomize.py": FORGE,
        })


    def workdir():
        fake_harbor_exec("/app")


    def user_code():
        code_dir = HERE.parent.parent  # the user-code dir: this package's parent
        fake_harbor_exec(code_dir)
        HERE.write_text(GENEROUS)  # the grader's module, rewritten where it lies
        plant(HERE.parent, {"main/__init__.py": GENEROUS})  # and shadowed by a package
        for cached in HERE.parent.glob("__pycache__/main.*.pyc"):
            cached.unlink()


    def rewrite():
        subprocess.Popen([sys.executable, "-c", REWRITER], start_new_session=True)
        # Running (and watching) before the runner writes the sample, however busy the
        # machine: the attack must have had its chance.
        deadline = time.monotonic() + 30
        while not os.path.exists("/tmp/rewriter-started") and time.monotonic() < deadline:
            time.sleep(0.01)


    def claims():
        class Mine(SampleSource):
            async def get_sample(self):
                return RolloutSample(messages=WRONG, reward=1.0, remove_sample=True)

        get_rollout_context().set_sample_source(Mine())


    def flood():
        chunk = bytes(1 << 20)
        with open("/logs/artifacts/flood.bin", "wb") as out:
            for _ in range(300):  # past the copy-back's 256 MiB
                out.write(chunk)


    ATTACKS = {
        "workdir": workdir, "user-code": user_code, "rewrite": rewrite,
        "claims": claims, "flood": flood,
    }


    class Attack(AgentWorkflow):
        async def run(self, ctx):
            ATTACKS[ctx.prompt[-1]["content"]]()
            return None if ctx.prompt[-1]["content"] == "claims" else WRONG


    class ExactMatch(Grader):
        async def grade(self, ctx):
            sample = ctx.sample
            answer = sample.messages[-1]["content"] if sample and sample.messages else ""
            sample.metrics["honest_grader"] = 1.0
            ctx.set_reward(1.0 if answer == ctx.label else 0.0)
'''

ATTACKS = ["workdir", "user-code", "rewrite", "claims", "flood"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("one-module-hostile")
    project = write_project(
        root / "project",
        {
            "pyproject.toml": flit_pyproject("hostile-one"),
            "hostile_one/__init__.py": '"""Hostile workflows beside their grader."""\n',
            "hostile_one/main.py": MODULE,
        },
    )
    built = build_bundle(
        project,
        workflow="hostile_one.main:Attack",
        grader="hostile_one.main:ExactMatch",
        cache_dir=root / "cache",
    )
    # The layout the test is about: the grader's module goes into the agent's container.
    assert built.manifest.grader_exposed and built.manifest.grader_only == []
    return built


def workdir_artifact_task(root: Path) -> Path:
    """The template task (WORKDIR /app) without tests (the bundled grader verifies),
    declaring /app an artifact: a separate verifier gets the agent's workdir back."""
    task = root / "workdir-artifact"
    shutil.copytree(REPO_ROOT / "tasks_examples" / "template", task)
    shutil.rmtree(task / "tests")
    toml = task / "task.toml"
    toml.write_text('artifacts = ["/app"]\n' + toml.read_text())
    return task


@pytest.mark.parametrize("mode", ["separate", "shared"])
def test_hostile_workflows_beside_their_grader_keep_the_honest_zero(
    tmp_path: Path, bundle: Any, chat: FakeChat, mode: Literal["separate", "shared"]
) -> None:
    backend = HarborBackend(
        tasks_dir=workdir_artifact_task(tmp_path),
        agent="hostile_one.main:Attack",
        grader="hostile_one.main:ExactMatch",
        bundle=bundle,
        grader_verifier_mode=mode,
        max_concurrent_trials=len(ATTACKS),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        cleanup_successful_trials=False,
    )
    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "served")

    async def attack(url: str, name: str) -> Any:
        async with httpx.AsyncClient(timeout=180) as http:
            return await RolloutClient(url=url, http_client=http).run_rollout(
                initial_messages=[{"role": "user", "content": name}],
                chat_completions_url=chat.base_url,
                rollout_id=f"{name}-{uuid.uuid4().hex[:8]}",
                llm_api_key="sk-test-" + uuid.uuid4().hex,
                label="42",
            )

    async def all_attacks(url: str) -> list[Any]:
        return list(await asyncio.gather(*(attack(url, name) for name in ATTACKS)))

    with serve(app) as url:
        results = dict(zip(ATTACKS, asyncio.run(all_attacks(url)), strict=True))
    for name, result in results.items():
        assert result.status == "success", (name, result.err_category, result.err_message)
        sample = result.sample
        assert sample.reward == 0.0, name
        assert sample.remove_sample is False, name
        assert sample.metrics["honest_grader"] == 1.0, name
        assert sample.messages[-1]["content"] == "41", name
    # The attacks had their chance: the detached rewrite did rewrite the container's
    # file, the flood did end as the agent's error (named beside the kept zero).
    rewritten = list((tmp_path / "trials").glob("rewrite-*/agent/rewritten.txt"))
    assert rewritten, "the rewriter never ran"
    flood = results["flood"].sample.extra_fields["agent_error"]
    assert flood["exception_type"] == "AgentOutputLimitError"
