"""The OpenAI Agents SDK project in HarborBackend's task containers (real Docker).

``tests/projects/osmosis_agents_project`` (built on osmosis-ai's OpenAI Agents
integration; its pyproject lists ``osmosis-ai[openai-agents]``) is bundled for the
read-only runtime's CPython: openai-agents, litellm and the rest go into the
bundle's dependency environment from PyPI at bundle time; the trial container is
offline and reaches the scripted model only through the relay. The rollout's reward
and sample (the session's items) are what osmosis-ai's own LocalBackend gives for the
same inputs, run here side by side against the same scripted model.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler import Bundle, build_bundle
from harbor_exec.server.app import create_rollout_server
from tests.bundle_utils import bundle_cache
from tests.fake_chat import ScriptedChat
from tests.osmosis_side_by_side import comparable, run_osmosis_rollout, template_without_tests
from tests.server_utils import serve
from tests.test_osmosis_agents_sdk import AGENTS_REFS, PROJECT, add_call

if sys.version_info < (3, 12):
    pytest.skip("osmosis-ai 0.3.8 is installed on Python >= 3.12 only", allow_module_level=True)

from osmosis_ai.rollout import LocalBackend as OsmosisLocalBackend
from osmosis_ai.rollout.server.app import (
    create_rollout_server as create_osmosis_server,
)

# engine_lane: its own project and backends; no timing bounds.
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

__all__ = ["bundle_cache"]  # the session fixture, used below

PROMPT = [{"role": "user", "content": "What is 6+7?"}]
KEY = "sk-agents-docker-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def agents_bundle(bundle_cache: Path) -> Bundle:
    """openai-agents, litellm and their wheels for the runtime's CPython come from
    PyPI the first time, then from the shared cache."""
    started = time.monotonic()
    bundle = build_bundle(PROJECT, cache_dir=bundle_cache, **AGENTS_REFS)
    print(f"agents bundle built in {time.monotonic() - started:.1f}s (cached: {bundle.cached})")
    return bundle


@pytest.fixture(scope="module")
def scripted() -> Iterator[ScriptedChat]:
    with ScriptedChat([add_call(6, 7), "13"], per_conversation=True) as chat:
        yield chat


async def _run(url: str, chat_url: str, label: str, rollout_id: str) -> Any:
    return await run_osmosis_rollout(
        url,
        chat_url,
        rollout_id,
        PROMPT,
        admission_timeout_sec=60,
        timeout_sec=300,
        llm_api_key=KEY,
        label=label,
    )


def test_bundle_carries_the_integration(agents_bundle: Bundle) -> None:
    wheels = {wheel.filename for wheel in agents_bundle.manifest.wheelhouse}
    for name in ("openai_agents-", "litellm-", "osmosis_ai-0.3.8-", "openai-"):
        assert any(wheel.startswith(name) for wheel in wheels), name


def test_agents_project_in_a_container_as_in_osmosis_local_backend(
    tmp_path: Path, scripted: ScriptedChat, agents_bundle: Bundle
) -> None:
    backend = HarborBackend(
        tasks_dir=template_without_tests(tmp_path),
        agent=AGENTS_REFS["workflow"],
        grader=AGENTS_REFS["grader"],
        bundle=agents_bundle,
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
    )
    monkeypatch = pytest.MonkeyPatch()
    # The integration's litellm in this process (osmosis-ai's backend): offline too.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("LITELLM_OFFLINE_MODE", "true")
    monkeypatch.setenv("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", str(tmp_path / "osmosis-root"))
    reference_app = create_osmosis_server(
        backend=OsmosisLocalBackend(**AGENTS_REFS), configure_logging=False
    )
    ours_app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    rollout_id = uuid.uuid4().hex
    try:
        with serve(reference_app) as reference_url, serve(ours_app) as ours_url:
            reference = asyncio.run(_run(reference_url, scripted.base_url, "13", rollout_id))
            before = len(scripted.requests)
            started = time.monotonic()
            ours = asyncio.run(_run(ours_url, scripted.base_url, "13", rollout_id))
            print(f"container rollout took {time.monotonic() - started:.1f}s")
            wrong = asyncio.run(_run(ours_url, scripted.base_url, "14", uuid.uuid4().hex))
    finally:
        monkeypatch.undo()
    for name, result in (("ours", ours), ("reference", reference)):
        dumped = json.dumps(comparable(result), indent=1, sort_keys=True)
        (tmp_path / f"{name}.json").write_text(dumped)  # for a diff when they disagree
    assert ours.status.value == "success", ours.err_message
    # One difference, by design: the agent's container never sees the label, so the
    # host gives the sample the request's label; osmosis-ai's LocalBackend keeps the
    # sample source's (the session's: None).
    assert (ours.sample.label, reference.sample.label) == ("13", None)
    assert comparable(ours, exclude={"label"}) == comparable(reference, exclude={"label"})
    assert ours.sample is not None and ours.sample.reward == 1.0
    items = ours.sample.messages
    assert [item.get("type") or item.get("role") for item in items] == [
        "user",
        "function_call",
        "function_call_output",
        "message",
    ]
    assert items[2]["output"] == "13.0" and items[3]["content"][0]["text"] == "13"
    assert ours.sample.metrics["tool_calls"] == 1.0
    assert (wrong.status.value, wrong.sample.reward if wrong.sample else None) == ("success", 0.0)
    # The container's requests went through the relay, streamed, with the real key
    # (the container only ever had the relay's token), and included the tool's result.
    container_requests = scripted.requests[before:]
    assert len(container_requests) >= 2
    assert all(r.body.get("stream") is True for r in container_requests)
    assert all(r.authorization == f"Bearer {KEY}" for r in container_requests)
