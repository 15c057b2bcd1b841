"""10,000 rollouts through one server: memory returns to its baseline after retention."""

from __future__ import annotations

import asyncio
import gc
import sys
import time
import uuid
from pathlib import Path

import pytest

from harbor_exec.client import RolloutClient
from harbor_exec.protocol import RolloutStatus
from tests.server_utils import CHAT_URL, PROMPT, UNLIMITED, local_app, serve, wait_until

ROLLOUTS = 10_000
WARM_UP = 200
CONCURRENCY = 32
# Long enough that a client under CI load always fetches its result before it expires.
RETENTION_SEC = 2.0
LEASE_SEC = 3.0
# uvicorn's keep-alive timers (one per request, cancelled but still queued in
# the event loop until they are due) are let go after this.
KEEP_ALIVE_SEC = 0.5
TIME_LIMIT_SEC = 150.0
# Interpreter blocks allowed to remain (bounded caches); a leak of one block per
# rollout would leave 10,000.
SLACK_BLOCKS = 5_000


async def _drive(url: str, count: int) -> int:
    """Run ``count`` rollouts at CONCURRENCY (bounded by TIME_LIMIT_SEC); returns successes."""
    deadline = time.monotonic() + TIME_LIMIT_SEC
    issued = succeeded = 0
    async with RolloutClient(url=url) as client:

        async def worker() -> None:
            nonlocal issued, succeeded
            while issued < count and time.monotonic() < deadline:
                issued += 1
                result = await client.run_rollout(PROMPT, CHAT_URL, uuid.uuid4().hex, label="4")
                if result.status is RolloutStatus.SUCCESS and result.sample is not None:
                    succeeded += result.sample.reward == 1.0

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return succeeded


def _settled_blocks() -> int:
    gc.collect()
    return sys.getallocatedblocks()


@pytest.mark.long
def test_memory_returns_to_baseline_after_10000_rollouts(tmp_path: Path) -> None:
    app = local_app(
        tmp_path,
        workflow_config=UNLIMITED,
        result_wait_timeout_sec=1.0,
        polling_lease_timeout_sec=LEASE_SEC,
        result_retention_sec=RETENTION_SEC,
    )
    service = app.state.rollout_service
    registry = service.registry

    def drained() -> bool:
        return (
            not registry.entries
            and not registry._lease_heap
            and not registry._retained
            and not service.tasks
            and service.writer.flush(0)
        )

    with serve(app, keep_alive_sec=KEEP_ALIVE_SEC) as url:
        # Warm-up: imports, caches, connection pools, the writer thread.
        assert asyncio.run(_drive(url, WARM_UP)) == WARM_UP
        assert wait_until(drained, timeout=LEASE_SEC + RETENTION_SEC + 5)
        time.sleep(KEEP_ALIVE_SEC + 0.5)
        baseline = _settled_blocks()

        started = time.monotonic()
        succeeded = asyncio.run(_drive(url, ROLLOUTS))
        elapsed = time.monotonic() - started
        assert succeeded == ROLLOUTS, f"{succeeded} of {ROLLOUTS} in {elapsed:.1f}s"
        peak_entries = len(registry.entries)

        # Results are held for the retention, leases until their deadline.
        assert wait_until(drained, timeout=LEASE_SEC + RETENTION_SEC + 5)
        time.sleep(KEEP_ALIVE_SEC + 0.5)
        after = _settled_blocks()

    print(f"blocks: baseline {baseline}, after {after}, delta {after - baseline}")
    assert peak_entries > 0  # they were retained for a while, then let go
    assert after - baseline < SLACK_BLOCKS, (
        f"{after - baseline} interpreter blocks still allocated after {ROLLOUTS} rollouts "
        f"(baseline {baseline})"
    )
    assert service.metrics.admitted == ROLLOUTS + WARM_UP
    assert len(list(tmp_path.glob("*/trajectory.json"))) == ROLLOUTS + WARM_UP
