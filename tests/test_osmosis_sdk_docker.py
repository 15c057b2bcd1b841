"""An SDK-authored project in HarborBackend's task containers (real Docker).

``tasks_examples/osmosis_sdk_project`` (a workflow and grader that subclass
osmosis-ai 0.3.8's classes, with osmosis-ai as a declared dependency) is bundled for
the read-only runtime's CPython 3.13: osmosis-ai and its dependencies go into the
bundle's dependency environment, and the runner runs the SDK classes through
``harbor_exec.compat.osmosis`` with the SDK's rollout context wired to the relay.
The reward and sample are what osmosis-ai's own LocalBackend gives
(tests/test_osmosis_sdk.py compares the two side by side).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler import Bundle, build_bundle
from harbor_exec.client import RolloutClient
from harbor_exec.server.app import create_rollout_server
from tests.bundle_utils import REPO_ROOT, bundle_cache
from tests.fake_chat import FakeChat
from tests.osmosis_side_by_side import template_without_tests
from tests.server_utils import serve

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

__all__ = ["bundle_cache"]  # the session fixture, used below

SDK_PROJECT = REPO_ROOT / "tasks_examples" / "osmosis_sdk_project"
SDK_REFS: dict[str, Any] = {
    "workflow": "sdk_arith.workflow:SdkArithWorkflow",
    "workflow_config": "sdk_arith.workflow:workflow_config",
    "grader": "sdk_arith.grader:SdkArithGrader",
    "grader_config": "sdk_arith.grader:grader_config",
}


@pytest.fixture(scope="session")
def sdk_bundle(bundle_cache: Path) -> Bundle:
    """Built once per session (osmosis-ai's wheels for cp313 come from PyPI the first
    time, then from the shared cache)."""
    started = time.monotonic()
    bundle = build_bundle(SDK_PROJECT, cache_dir=bundle_cache, **SDK_REFS)
    print(f"SDK bundle built in {time.monotonic() - started:.1f}s (cached: {bundle.cached})")
    return bundle


def test_sdk_bundle_carries_osmosis_ai_for_cp313(sdk_bundle: Bundle) -> None:
    wheels = {wheel.filename for wheel in sdk_bundle.manifest.wheelhouse}
    assert any(name.startswith("osmosis_ai-0.3.8-") for name in wheels)
    assert any("cp313" in name for name in wheels if name.startswith("pydantic_core-"))
    assert sdk_bundle.manifest.python_version == "3.13"


def test_sdk_workflow_and_grader_in_a_container(
    tmp_path: Path, chat: FakeChat, sdk_bundle: Bundle
) -> None:
    chat.reset()
    backend = HarborBackend(
        tasks_dir=template_without_tests(tmp_path),
        agent=SDK_REFS["workflow"],
        grader=SDK_REFS["grader"],
        bundle=sdk_bundle,
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
    )
    key = "sk-test-" + uuid.uuid4().hex

    async def one(url: str, label: str, metadata: dict[str, Any] | None = None) -> Any:
        async with httpx.AsyncClient(timeout=300) as http:
            return await RolloutClient(url=url, http_client=http).run_rollout(
                initial_messages=[{"role": "user", "content": "What is 6 * 7?"}],
                chat_completions_url=chat.base_url,
                rollout_id=uuid.uuid4().hex,
                llm_api_key=key,
                label=label,
                metadata=metadata,
            )

    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    with serve(app) as url:
        right = asyncio.run(one(url, "42"))
        wrong = asyncio.run(one(url, "41"))
        raised = asyncio.run(one(url, "42", {"raise": "the agent broke"}))
    assert right.status == "success", right.err_message
    assert right.sample.reward == 1.0
    assert right.sample.messages[-1] == {"role": "assistant", "content": "42"}
    assert right.sample.messages[0]["content"].startswith("You are a calculator")
    assert right.sample.metrics["turns"] == 1.0
    assert right.sample.metrics["graded_by"] == "sdk"
    assert wrong.status == "success" and wrong.sample.reward == 0.0
    # A workflow that raises: osmosis-ai's classification, its message.
    assert (raised.status, raised.err_category) == ("failure", "agent_error")
    assert "the agent broke" in (raised.err_message or "")
    # The model saw the rollout's requests through the relay, with the real key
    # (the container only ever had the relay's token).
    assert chat.authorizations and all(a == f"Bearer {key}" for a in chat.authorizations)
    assert chat.requests[0].body["model"] == "sdk-model"
