"""RayExecutor vs LocalExecutor on this machine: dispatch overhead and throughput.

Run as root (it creates a network namespace with only loopback up, where Ray binds
127.0.0.1): ``.venv/bin/python bench/bench_ray.py``. A two-worker-node cluster
(``tests/ray_cluster.py``) shares the local Docker engine with the local executor.

* overhead: N oracle trials of hello-shell at concurrency 4, each executor; the
  per-trial wall time difference is the Ray dispatch overhead (target: under 15%);
* throughput: 16 oracle trials over two worker nodes at concurrency 8 vs the local
  executor at 8 (target: within 1.3x).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "tasks_examples" / "dataset" / "hello-shell"


async def _batch(executor: object, count: int, concurrency: int, trials: Path) -> list[float]:
    from harbor_exec.tasks.task import load_task
    from harbor_exec.trial.spec import TrialSpec

    task = load_task(TASK)
    gate = asyncio.Semaphore(concurrency)
    times: list[float] = []

    async def one() -> None:
        async with gate:
            started = time.monotonic()
            run = await executor.submit(TrialSpec(task, trials)).result()  # type: ignore[attr-defined]
            assert run.result.exception_info is None, run.result.exception_info
            times.append(time.monotonic() - started)

    await asyncio.gather(*(one() for _ in range(count)))
    return times


async def inner(address: str) -> None:
    from harbor_exec.executors.local import LocalExecutor
    from harbor_exec.executors.ray import RayExecutor, wait_for_nodes

    out: dict[str, object] = {}
    ray_executor = RayExecutor(address)
    await asyncio.to_thread(wait_for_nodes, ray_executor, 2)
    local = LocalExecutor()
    with tempfile.TemporaryDirectory() as scratch:
        trials = Path(scratch)
        for name, executor in (("local", local), ("ray", ray_executor)):
            await _batch(executor, 4, 4, trials)  # warm: images, actors, caches
            cpu = time.process_time()
            per_trial = await _batch(executor, 12, 4, trials)
            cpu = time.process_time() - cpu
            started = time.monotonic()
            await _batch(executor, 16, 8, trials)
            out[name] = {
                "per_trial_sec_c4": round(sum(per_trial) / len(per_trial), 3),
                "wall_16_c8_sec": round(time.monotonic() - started, 2),
                # This process's CPU (all its threads) per trial: the server's cost.
                "server_cpu_ms_per_trial": round(cpu / len(per_trial) * 1000, 1),
            }
    local_s, ray_s = out["local"], out["ray"]  # type: ignore[assignment]
    out["dispatch_overhead"] = round(ray_s["per_trial_sec_c4"] / local_s["per_trial_sec_c4"] - 1, 3)  # type: ignore[index]
    out["throughput_ratio"] = round(ray_s["wall_16_c8_sec"] / local_s["wall_16_c8_sec"], 3)  # type: ignore[index]
    out["nodes"] = [n.model_dump() for n in ray_executor.nodes()]
    with contextlib.suppress(Exception):
        out["profile"] = ray_executor.timings()
    await local.aclose()
    await ray_executor.aclose()
    print(json.dumps(out, indent=2), flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--inner":
        asyncio.run(inner(sys.argv[2]))
        return
    netns = f"hx-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True)
        cluster = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, str(ROOT / "tests" / "ray_cluster.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert cluster.stdout is not None and cluster.stdin is not None
        line = cluster.stdout.readline()
        address = json.loads(line)["address"]
        subprocess.run(
            ["ip", "netns", "exec", netns, sys.executable, __file__, "--inner", address],
            check=True,
            timeout=900,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        cluster.stdin.write("quit\n")
        cluster.stdin.flush()
        cluster.wait(timeout=60)
    finally:
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "delete", netns], check=False)


if __name__ == "__main__":
    main()
