"""Which tasks a request may name, and what their ``${VAR}`` templates may read.

Chained attack this guards against: rollout 1 writes a task into
``/logs/artifacts`` (copied to the artifact root), rollout 2 names that copy as
its ``metadata.harbor_task``, whose ``task.toml`` reads a server secret through
``${VAR}``. Every refusal is the same message, whether or not the path exists.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.protocol import ExecutionOutcome, ExecutionRequest
from tests.task_factory import make_task

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

SECRET_NAME = "HARBOR_EXEC_TEST_SERVER_SECRET"
LEAKY_TOML = f"""
[agent]
timeout_sec = 30.0
[verifier]
timeout_sec = 30.0
[environment.env]
LEAKED = "${{{SECRET_NAME}}}"
"""


@pytest.fixture()
def server_secret() -> Iterator[str]:
    value = "server-secret-" + uuid.uuid4().hex
    os.environ[SECRET_NAME] = value
    yield value
    del os.environ[SECRET_NAME]


def execute(backend: HarborBackend, metadata: dict[str, Any]) -> ExecutionOutcome:
    request = ExecutionRequest(id=uuid.uuid4().hex, prompt=[], metadata=metadata)
    return asyncio.run(backend.execute(request))


def refusal(outcome: ExecutionOutcome) -> str:
    assert outcome.workflow.status == "failure"
    assert outcome.workflow.err_category == "validation_error"
    return str(outcome.workflow.err_message)


def dataset_backend(tmp_path: Path, **kwargs: Any) -> HarborBackend:
    tasks = tmp_path / "tasks"
    make_task(tasks, "ok", test="echo 1 > /logs/verifier/reward.txt")
    return HarborBackend(
        tasks_dir=tasks,
        task_mode="dataset",
        agent="oracle",
        trials_dir=kwargs.pop("trials_dir", tmp_path / "trials"),
        artifacts_dir=kwargs.pop("artifacts_dir", tmp_path / "artifacts"),
        **kwargs,
    )


def test_harbor_task_outside_the_roots_gets_one_message(tmp_path: Path) -> None:
    # The artifact root inside the tasks dir: still never a task root.
    backend = dataset_backend(tmp_path, artifacts_dir=tmp_path / "tasks" / "artifacts")
    planted = make_task(backend.artifacts_dir / "r1" / "artifacts", "planted")
    elsewhere = make_task(tmp_path / "elsewhere", "t")
    for ref in ("/etc", "/no/such/path", str(planted), str(elsewhere), "./../elsewhere/t"):
        message = refusal(execute(backend, {"harbor_task": ref}))
        assert message == f"harbor_task {ref!r} is not under a served task root"
    served = execute(backend, {"harbor_task": str(tmp_path / "tasks" / "ok")})
    assert served.grader is not None and served.grader.status == "success"
    assert served.grader.sample is not None and served.grader.sample.reward == 1.0


def test_task_root_option_and_env_allowlist(tmp_path: Path, server_secret: str) -> None:
    extra_root = tmp_path / "extra"
    leaky = make_task(
        extra_root,
        "leaky",
        toml=LEAKY_TOML,
        test='[ -n "$LEAKED" ] && echo "$LEAKED" > /logs/verifier/leak; echo 1 > /logs/verifier/reward.txt',
    )
    refused = dataset_backend(tmp_path / "a", task_roots=[extra_root])
    message = refusal(execute(refused, {"harbor_task": str(leaky)}))
    assert SECRET_NAME in message and "--task-env-allow" in message
    assert server_secret not in message

    allowed = dataset_backend(tmp_path / "b", task_roots=[extra_root], task_env_allow=[SECRET_NAME])
    outcome = execute(allowed, {"harbor_task": str(leaky)})
    assert outcome.grader is not None and outcome.grader.status == "success"
    # The operator's own tasks (by id) still read the host environment as Harbor does.
    make_task(refused.tasks_dir, "own", toml=LEAKY_TOML)
    own = execute(refused, {"harbor_task_id": "own"})
    assert own.grader is not None and own.grader.status == "success"


def test_symlink_added_after_first_rollout_is_refused(tmp_path: Path) -> None:
    backend = dataset_backend(tmp_path)
    first = execute(backend, {"harbor_task_id": "ok"})
    assert first.grader is not None and first.grader.status == "success"
    (backend.tasks_dir / "ok" / "tests" / "leak").symlink_to("/etc/shadow")
    message = refusal(execute(backend, {"harbor_task_id": "ok"}))
    assert "tests/leak" in message and "outside the task" in message
