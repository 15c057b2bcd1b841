"""The real osmosis-ai 0.3.8 RolloutClient drives our server through every
"must hold" case of issue 3, each with the result the reference documents.

One documented improvement shows here: LocalBackend keeps a rollout ``queued``
while it waits for a concurrency slot, so cancelling it then answers
``cancelled_queued`` (the reference says ``cancelled_running``).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_utils import (
    CHAT_URL,
    NEVER,
    PROMPT,
    SINGLE_SLOT,
    FullBackend,
    local_app,
    serve,
    wait_until,
    wait_until_async,
    workflow_was_cancelled,
)

# osmosis-ai 0.3.8 requires Python >= 3.12. A plain bool rather than an
# `if sys.version_info` test, so that mypy (which checks as 3.11) still reads this module.
OSMOSIS_PYTHON = sys.version_info >= (3, 12)
if not OSMOSIS_PYTHON:
    pytest.skip("osmosis-ai 0.3.8 is installed on Python >= 3.12 only", allow_module_level=True)

from osmosis_ai.rollout.client import (  # noqa: E402 (after the version guard)
    RolloutAdmissionTimeoutError,
    RolloutClient,
    RolloutProtocolError,
)
from osmosis_ai.rollout.types import RolloutInitResponse, RolloutStatus  # noqa: E402


def new_id() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    app = local_app(
        tmp_path_factory.mktemp("osmosis"),
        workflow_config=SINGLE_SLOT,
        result_wait_timeout_sec=2.0,
        polling_lease_timeout_sec=30.0,
    )
    with serve(app, graceful_shutdown_sec=1.0) as url:
        yield url


@pytest.fixture
async def client(server_url: str) -> AsyncIterator[RolloutClient]:
    rollout_client = RolloutClient(url=server_url, admission_timeout_sec=30)
    yield rollout_client
    await rollout_client.aclose()


async def test_graded_success(client: RolloutClient) -> None:
    result = await client.run_rollout(
        PROMPT, CHAT_URL, new_id(), label="4", extra_fields={"row_index": 0}
    )
    assert (result.status.value, result.err_message, result.err_category) == (
        "success",
        None,
        None,
    )
    assert result.sample is not None and result.sample.reward == 1.0
    assert result.sample.label == "4"
    assert [m["content"] for m in result.sample.messages] == ["What is 2+2?", "4"]
    # Filled in by the reference model from messages: the wire left it out.
    assert result.sample.trajectory_messages == result.sample.messages


async def test_wrong_answer_scores_zero(client: RolloutClient) -> None:
    result = await client.run_rollout(
        PROMPT, CHAT_URL, new_id(), label="4", metadata={"answer": "5"}
    )
    assert result.status.value == "success"
    assert result.sample is not None and result.sample.reward == 0.0


async def test_grade_false(client: RolloutClient) -> None:
    result = await client.run_rollout(PROMPT, CHAT_URL, new_id(), label="4", grade=False)
    assert result.status.value == "success"
    assert result.sample is not None and result.sample.reward is None


async def test_remove_sample(client: RolloutClient) -> None:
    result = await client.run_rollout(
        PROMPT, CHAT_URL, new_id(), label="4", metadata={"remove": True}
    )
    assert result.status.value == "success"
    assert result.sample is not None
    assert (result.sample.remove_sample, result.sample.reward) == (True, None)


async def test_workflow_exception(client: RolloutClient) -> None:
    result = await client.run_rollout(PROMPT, CHAT_URL, new_id(), metadata={"raise": "boom"})
    assert (result.status.value, result.err_message, result.err_category) == (
        "failure",
        "boom",
        "agent_error",
    )
    assert result.sample is None


async def test_agent_timeout(client: RolloutClient) -> None:
    result = await client.run_rollout(
        PROMPT, CHAT_URL, new_id(), label="4", metadata={"hold": NEVER}, agent_timeout_sec=0.3
    )
    assert (result.status.value, result.err_category, result.err_message) == (
        "failure",
        "timeout",
        "workflow exceeded its 0.3s deadline",
    )


async def test_cancel_while_running_and_while_queued(
    client: RolloutClient, server_url: str
) -> None:
    running = await client.run_rollout_async(
        PROMPT, CHAT_URL, new_id(), label="4", metadata={"hold": NEVER}
    )
    assert (await asyncio.wait_for(running.wait_for_running(), 5)).value == "running"
    queued = await client.run_rollout_async(
        PROMPT, CHAT_URL, new_id(), label="4", metadata={"hold": NEVER}
    )

    async def one_queued() -> bool:
        async with httpx.AsyncClient() as http:
            return bool((await http.get(f"{server_url}/queue")).json()["queued"] == 1)

    assert await wait_until_async(one_queued)
    assert queued.status.value == "queued"
    assert (await client.cancel_rollout(queued.rollout_id)).dispositions == {
        queued.rollout_id: "cancelled_queued"
    }
    assert (await client.cancel_rollout(running.rollout_id)).dispositions == {
        running.rollout_id: "cancelled_running"
    }
    # Idempotent: a second cancel finds nothing to cancel.
    assert (await client.cancel_rollout(running.rollout_id)).dispositions == {
        running.rollout_id: "not_found"
    }
    for handle in (running, queued):
        result = await asyncio.wait_for(handle.wait_for_completion(), 10)
        assert result.status.value == "cancelled"
    assert wait_until(lambda: workflow_was_cancelled(running.rollout_id))


async def test_duplicate_id_is_409(client: RolloutClient) -> None:
    rollout_id = new_id()
    handle = await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id, label="4")
    with pytest.raises(RolloutProtocolError) as caught:
        await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id, label="4")
    assert caught.value.status_code == 409
    assert (await handle).status.value == "success"
    with pytest.raises(RolloutProtocolError) as retained:
        await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id, label="4")
    assert retained.value.status_code == 409


async def test_wrong_lease_is_403_and_unknown_id_is_404(client: RolloutClient) -> None:
    rollout_id = new_id()
    handle = await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id, label="4")
    await handle
    forged = RolloutInitResponse(
        rollout_id=rollout_id,
        status=RolloutStatus.QUEUED,
        polling_lease_token="wrong-token",
        result_wait_timeout_sec=2.0,
        polling_lease_timeout_sec=30.0,
    )
    with pytest.raises(RolloutProtocolError) as wrong:
        await client._get_result(forged, lease_deadline=time.monotonic() + 30)
    assert wrong.value.status_code == 403
    unknown = forged.model_copy(update={"rollout_id": new_id()})
    with pytest.raises(RolloutProtocolError) as missing:
        await client._get_result(unknown, lease_deadline=time.monotonic() + 30)
    assert missing.value.status_code == 404


async def test_bearer_key(tmp_path: Path) -> None:
    with serve(local_app(tmp_path, api_key="osmosis-key")) as url:
        anonymous = RolloutClient(url=url)
        with pytest.raises(RolloutProtocolError) as caught:
            await anonymous.run_rollout(PROMPT, CHAT_URL, new_id(), label="4")
        assert caught.value.status_code == 401
        await anonymous.aclose()
        keyed = RolloutClient(url=url, api_key="osmosis-key")
        result = await keyed.run_rollout(PROMPT, CHAT_URL, new_id(), label="4")
        assert result.status.value == "success"
        idle = await keyed.wait_idle(timeout_sec=10, poll_interval_sec=0.05)
        assert idle["lifecycle"] == {"accepting_rollouts": True, "active_rollouts": 0}
        await keyed.aclose()


async def test_full_backend_waits_then_succeeds(tmp_path: Path) -> None:
    backend = FullBackend(tmp_path, refusals=2)
    with serve(local_app(tmp_path, backend=backend)) as url:
        patient = RolloutClient(url=url, admission_timeout_sec=20)
        started = time.monotonic()
        result = await patient.run_rollout(PROMPT, CHAT_URL, new_id(), label="4")
        assert result.status.value == "success"
        assert time.monotonic() - started >= 1.8  # honoured Retry-After: 1, twice
        await patient.aclose()
        backend.refusals = 10**6
        hurried = RolloutClient(url=url, admission_timeout_sec=0.5)
        with pytest.raises(RolloutAdmissionTimeoutError):
            await hurried.run_rollout(PROMPT, CHAT_URL, new_id(), label="4")
        await hurried.aclose()


async def test_lease_expiry(tmp_path: Path) -> None:
    app = local_app(tmp_path, result_wait_timeout_sec=0.3, polling_lease_timeout_sec=0.8)
    with serve(app) as url:
        rollout_client = RolloutClient(url=url)
        handle = await rollout_client.run_rollout_async(
            PROMPT, CHAT_URL, new_id(), label="4", metadata={"hold": NEVER}
        )
        token = _token_of(handle)
        handle.cancel()  # the controller goes away: nobody polls any more

        async def lease_expired() -> bool:  # /status needs no lease and renews none
            async with httpx.AsyncClient() as http:
                status = (await http.get(f"{url}/rollout/{handle.rollout_id}/status")).json()
            return bool(status["status"] == "failure")

        assert await wait_until_async(lease_expired)
        admission = RolloutInitResponse(
            rollout_id=handle.rollout_id,
            status=RolloutStatus.QUEUED,
            polling_lease_token=token,
            result_wait_timeout_sec=0.3,
            polling_lease_timeout_sec=0.8,
        )
        result, _ = await rollout_client._get_result(admission, lease_deadline=time.monotonic() + 5)
        assert (result.status.value, result.err_category, result.err_message) == (
            "failure",
            "lease_expired",
            "polling lease expired",
        )
        assert wait_until(lambda: workflow_was_cancelled(handle.rollout_id))
        await rollout_client.aclose()


def _token_of(handle: object) -> str:
    """The lease token the reference handle polls with (held by its polling coroutine)."""
    task = handle.result_task  # type: ignore[attr-defined]
    frame = task.get_coro().cr_frame
    admission = frame.f_locals["admission"] if frame is not None else None
    assert admission is not None, "polling coroutine already finished"
    token: str = admission.polling_lease_token
    return token
