"""The read-only runtime on any image: a bundled workflow needs nothing from the task's image.

The same bundle (the example project: httpx from its dependency environment, the
relay through the runtime's forwarder) runs a rollout in an image without Python
(debian:bookworm-slim), in a musl image (no glibc at all: a static busybox and
musl's loader), as a non-root image ``USER``, and in python:3.11-slim-bookworm; every
one gets the same sample and reward. The init and keep-alive come from the runtime
as a uid of their own and are not dumpable: a root agent cannot open their memory,
and cannot write to the runtime.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler import Bundle, build_bundle
from harbor_exec.client import RolloutClient
from harbor_exec.container.exchange import RUNTIME_PYTHON
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime_volume import KEEP_ALIVE_UID
from harbor_exec.server.app import create_rollout_server
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from tests.bundle_utils import EXAMPLE_DIR, EXAMPLE_REFS
from tests.fake_chat import FakeChat
from tests.server_utils import serve
from tests.task_factory import make_task

# engine_lane("b"): its own tasks and bundles; no engine-wide counts, no wall-clock bound.
pytestmark = [
    pytest.mark.docker,
    pytest.mark.engine_lane("b"),
    pytest.mark.usefixtures("base_images"),
]

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "tasks_examples" / "template"
MUSL_LOADER = Path("/usr/lib/x86_64-linux-musl/libc.so")  # Debian's musl package
STATIC_BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static

IMAGES = {
    "python": "FROM python:3.11-slim-bookworm\nWORKDIR /app\n",
    "no-python": "FROM debian:bookworm-slim\nWORKDIR /app\n",
    "non-root": (
        "FROM debian:bookworm-slim\nRUN useradd -m -u 1000 agent && mkdir /app "
        "&& chown agent /app\nUSER agent\nWORKDIR /app\n"
    ),
    # busybox picks its applet by name: copies, no RUN (a scratch image has no shell yet).
    "musl": "FROM scratch\nCOPY ld-musl /lib/ld-musl-x86_64.so.1\n"
    + "".join(f"COPY busybox /bin/{applet}\n" for applet in ("busybox", "sh", "tar"))
    + "WORKDIR /app\n",
}


def grader_task(root: Path, kind: str) -> Path:
    """The template task on image ``kind``, without tests/: the bundled grader verifies."""
    task = root / f"template-{kind}"
    shutil.copytree(TEMPLATE, task)
    shutil.rmtree(task / "tests")
    (task / "environment" / "Dockerfile").write_text(IMAGES[kind])
    if kind == "musl":
        for path in (MUSL_LOADER, STATIC_BUSYBOX):
            assert path.is_file(), f"{path} is missing: run scripts/setup.sh"
        shutil.copyfile(MUSL_LOADER, task / "environment" / "ld-musl")
        shutil.copyfile(STATIC_BUSYBOX, task / "environment" / "busybox")
    return task


def rollout(tmp_path: Path, bundle: Bundle, task: Path, chat: FakeChat) -> Any:
    backend = HarborBackend(
        tasks_dir=task,
        agent=EXAMPLE_REFS["workflow"],
        grader=EXAMPLE_REFS["grader"],
        bundle=bundle,
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        cleanup_successful_trials=False,
    )

    async def one(url: str) -> Any:
        async with httpx.AsyncClient(timeout=300) as http:
            return await RolloutClient(url=url, http_client=http).run_rollout(
                initial_messages=[{"role": "user", "content": "What is 6 * 7?"}],
                chat_completions_url=chat.base_url,
                rollout_id=uuid.uuid4().hex,
                llm_api_key="sk-test-" + uuid.uuid4().hex,
                label="42",
            )

    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    with serve(app) as url:
        return asyncio.run(one(url))


def test_a_workflow_runs_the_same_on_every_image(tmp_path: Path, chat: FakeChat) -> None:
    chat.reset()
    example_bundle = build_bundle(EXAMPLE_DIR, cache_dir=tmp_path / "bundles", **EXAMPLE_REFS)
    samples: dict[str, Any] = {}
    for kind in IMAGES:
        result = rollout(tmp_path / kind, example_bundle, grader_task(tmp_path, kind), chat)
        assert result.status == "success", (kind, result.err_message)
        assert result.sample.reward == 1.0, kind
        samples[kind] = result.sample.messages
    # Same workflow, same model answers: the same chat everywhere.
    assert all(messages == samples["python"] for messages in samples.values()), samples
    assert samples["python"][-1]["content"].strip() == "42"


ATTACK = f"""
# A root agent goes for the processes the kill spares and for harbor-exec's runtime.
python3 - <<'EOF' > /logs/agent/attack.json
import json, os
found = {{}}
for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) == os.getpid():
        continue
    try:
        status = open(f"/proc/{{name}}/status").read()
    except OSError:
        continue
    uid = int(status.split("Uid:")[1].split()[0])
    try:
        open(f"/proc/{{name}}/mem", "r+b").close()
        mem = "opened"
    except OSError as exc:
        mem = type(exc).__name__
    found[name] = {{"uid": uid, "mem": mem}}
try:
    open("{RUNTIME_PYTHON}", "ab").close()
    runtime = "written"
except OSError as exc:
    runtime = type(exc).__name__
print(json.dumps({{"processes": found, "runtime": runtime}}))
EOF
"""


def test_a_root_agent_cannot_reach_the_init_the_keep_alive_or_the_runtime(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    task = make_task(
        tmp_path,
        "attack",
        solve=ATTACK,
        test="echo 0 > /logs/verifier/reward.txt",
        dockerfile="FROM python:3.11-slim-bookworm\nWORKDIR /app\n",
    )
    trials = tmp_path / "trials"
    result = run_trial(
        docker_runtime, TrialRequest(TrialSpec(task=load_task(task), trials_dir=trials))
    )
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 0.0}
    attack = json.loads((trials / result.trial_name / "agent" / "attack.json").read_text())
    spared = {pid: p for pid, p in attack["processes"].items() if p["uid"] == KEEP_ALIVE_UID}
    # The init (PID 1) and the keep-alive run as the runtime's uid; neither's memory opens,
    # for root either: they cannot read their own (execute-only) programs, so they are
    # not dumpable.
    assert "1" in spared and len(spared) == 2, attack
    assert all(p["mem"] == "PermissionError" for p in spared.values()), attack
    assert attack["runtime"] == "OSError", attack  # EROFS: mounted read-only
