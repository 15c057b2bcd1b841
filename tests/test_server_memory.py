"""10,000 rollouts through one server: memory returns to its baseline after retention."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.client import RolloutClient
from harbor_exec.protocol import RolloutStatus
from tests.server_utils import CHAT_URL, PROMPT, wait_until

ROOT = Path(__file__).resolve().parent.parent

ROLLOUTS = 10_000
WARM_UP = 200
CONCURRENCY = 32
# Long enough that a client under CI load always fetches its result before it expires.
RETENTION_SEC = 2.0
LEASE_SEC = 3.0
# uvicorn's keep-alive timers (one per request, cancelled but still queued in
# the event loop until they are due) are let go after this. uvicorn's default: the
# client drops idle connections before it (4 s), so no request meets a connection
# the server is closing (a shorter one made POSTs fail with "Server disconnected").
KEEP_ALIVE_SEC = 5.0
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


def _probe(http: httpx.Client, *, settle: bool = False) -> dict[str, Any]:
    answer = http.get("/_probe", params={"settle": settle})
    answer.raise_for_status()
    probe: dict[str, Any] = answer.json()
    return probe


@pytest.mark.slow
@pytest.mark.long(15)
def test_memory_returns_to_baseline_after_10000_rollouts(tmp_path: Path) -> None:
    # The server runs in its own process: its memory is measured alone, and the
    # client does not share its interpreter lock.
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.memory_server", str(tmp_path),
         str(LEASE_SEC), str(RETENTION_SEC), str(KEEP_ALIVE_SEC)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert server.stdout is not None and server.stdin is not None
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        http = httpx.Client(base_url=url, timeout=30)

        def drained() -> bool:
            return bool(_probe(http)["drained"])

        # Warm-up: imports, caches, connection pools, the writer thread.
        assert asyncio.run(_drive(url, WARM_UP)) == WARM_UP
        assert wait_until(drained, timeout=LEASE_SEC + RETENTION_SEC + 5, interval=0.1)
        time.sleep(KEEP_ALIVE_SEC + 0.5)
        baseline = _probe(http, settle=True)["blocks"]

        started = time.monotonic()
        succeeded = asyncio.run(_drive(url, ROLLOUTS))
        elapsed = time.monotonic() - started
        assert succeeded == ROLLOUTS, f"{succeeded} of {ROLLOUTS} in {elapsed:.1f}s"
        peak_entries = _probe(http)["entries"]

        # Results are held for the retention, leases until their deadline.
        assert wait_until(drained, timeout=LEASE_SEC + RETENTION_SEC + 5, interval=0.1)
        time.sleep(KEEP_ALIVE_SEC + 0.5)
        final = _probe(http, settle=True)
        after = final["blocks"]
        http.close()
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    print(f"blocks: baseline {baseline}, after {after}, delta {after - baseline}")
    assert peak_entries > 0  # they were retained for a while, then let go
    assert after - baseline < SLACK_BLOCKS, (
        f"{after - baseline} interpreter blocks still allocated after {ROLLOUTS} rollouts "
        f"(baseline {baseline})"
    )
    assert final["admitted"] == ROLLOUTS + WARM_UP
    assert len(list(tmp_path.glob("*/trajectory.json"))) == ROLLOUTS + WARM_UP
