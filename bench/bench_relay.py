"""Per-call overhead of the model relay: forwarder + relay vs calling the model directly.

Three processes, as in production: the fake OpenAI-compatible model
(``tests/fake_chat.py``) on 127.0.0.1; this process, running a ``ModelRelay``
on a unix socket; and ``python -m harbor_exec.container.runner agent`` with
``BenchWorkflow`` below, whose forwarder listens on 127.0.0.1 as it would in a
container. The workflow makes ``--calls`` chat calls each way with one httpx
client, alternating direct and relayed so drift hits both alike, and reports
every latency. Prints the medians (and p90) in ms, the overhead and the ratio
(target: under 2 ms overhead at the median), and what ``ModelRelay.start``
costs per rollout (target: under 5 ms at the median). Everything is bounded by
``--time-limit``.

    .venv/bin/python bench/bench_relay.py
    .venv/bin/python bench/bench_relay.py --calls 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harbor_exec.authoring import AgentWorkflow, AgentWorkflowConfig, AgentWorkflowContext

REPO_ROOT = Path(__file__).resolve().parents[1]
FAKE_KEY = "sk-bench-0123456789abcdef"
BODY = {"model": "m", "messages": [{"role": "user", "content": "What is 2 + 2?"}]}
WARMUP = 20
START_TARGET_MS = 5.0  # ModelRelay.start at the median, per rollout


class BenchWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    """Runs in the runner: times chat calls to the direct URL and through the relay."""

    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        import httpx

        from harbor_exec.authoring import get_rollout_context

        rollout = get_rollout_context()
        assert rollout is not None and ctx.metadata is not None
        calls = int(ctx.metadata["calls"])
        targets = {
            "direct": (ctx.metadata["direct_url"], ctx.metadata["direct_key"]),
            "relay": (rollout.chat_completions_url, rollout.api_key),
        }
        timings: dict[str, list[float]] = {name: [] for name in targets}
        async with httpx.AsyncClient(timeout=10) as client:
            for index in range(WARMUP + calls):
                for name, (url, key) in targets.items():
                    started = time.perf_counter()
                    response = await client.post(
                        f"{url}/chat/completions",
                        json=BODY,
                        headers={"Authorization": f"Bearer {key}"},
                    )
                    elapsed = time.perf_counter() - started
                    response.raise_for_status()
                    if index >= WARMUP:
                        timings[name].append(elapsed)
        return [*ctx.prompt, {"role": "assistant", "content": json.dumps(timings)}]


def _start_fake_model() -> tuple[subprocess.Popen[str], str]:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from fake_chat import FakeChat\n"
        "with FakeChat() as chat:\n"
        "    print(chat.base_url, flush=True); sys.stdin.read()\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(REPO_ROOT / "tests")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


async def _start_cost(directory: Path, upstream: str, count: int = 200) -> list[float]:
    from harbor_exec.network.relay import ModelRelay

    costs = []
    for index in range(count):
        relay = ModelRelay(
            upstream_url=upstream, api_key=FAKE_KEY, directory=directory / f"s{index}"
        )
        started = time.perf_counter()
        await relay.start()
        costs.append(time.perf_counter() - started)
        await relay.aclose()
    return costs


async def _bench(calls: int, time_limit: float) -> dict[str, Any]:
    from harbor_exec.network.relay import ModelRelay

    model, base_url = _start_fake_model()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-relay-", dir="/tmp") as tmp:
            root = Path(tmp)
            upstream = f"{base_url}/v1"
            start_costs = await _start_cost(root, upstream)
            relay = ModelRelay(upstream_url=upstream, api_key=FAKE_KEY, directory=root / "relay")
            async with relay:
                manifest = root / "manifest.json"
                manifest.write_text(
                    json.dumps({"format_version": 1, "workflow": "bench.bench_relay:BenchWorkflow"})
                )
                rollout = {
                    "version": 1,
                    "rollout_id": "bench",
                    "prompt": [{"role": "user", "content": "bench"}],
                    "metadata": {"calls": calls, "direct_url": upstream, "direct_key": FAKE_KEY},
                    "api_key": relay.token,
                    "relay": {"socket": str(relay.socket_path), "path": relay.path_prefix},
                }
                (root / "logs" / "agent").mkdir(parents=True)
                (root / "logs" / "agent" / "rollout.json").write_text(json.dumps(rollout))
                runner = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "harbor_exec.container.runner",
                    "agent",
                    "--manifest",
                    str(manifest),
                    "--logs-dir",
                    str(root / "logs"),
                    "--tests-dir",
                    str(root / "tests"),
                    env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                )
                try:
                    output, _ = await asyncio.wait_for(runner.communicate(), time_limit)
                except TimeoutError:
                    runner.kill()
                    await runner.wait()
                    raise SystemExit(f"the bench took over {time_limit:.0f} s") from None
                if runner.returncode != 0:
                    raise SystemExit(f"the runner failed:\n{output.decode()}")
                sample = json.loads((root / "logs" / "agent" / "sample.json").read_text())
                usage = relay.usage
        timings: dict[str, list[float]] = json.loads(sample["messages"][-1]["content"])
        return {"timings": timings, "start_costs": start_costs, "usage": usage}
    finally:
        assert model.stdin is not None
        model.stdin.close()
        model.wait(timeout=10)


def _ms(values: list[float], quantile: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="calls each way (default 500)")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds (default 300)")
    args = parser.parse_args()
    result = asyncio.run(_bench(args.calls, args.time_limit))
    direct, relayed = result["timings"]["direct"], result["timings"]["relay"]
    direct_ms, relay_ms = _ms(direct, 0.5), _ms(relayed, 0.5)
    print(f"chat calls each way: {len(direct)} (after {WARMUP} warm-up)")
    print(f"direct   median {direct_ms:.3f} ms   p90 {_ms(direct, 0.9):.3f} ms")
    print(f"relayed  median {relay_ms:.3f} ms   p90 {_ms(relayed, 0.9):.3f} ms")
    print(
        f"overhead median {relay_ms - direct_ms:.3f} ms   ratio {relay_ms / direct_ms:.2f}x"
        f"   (target < 2 ms)"
    )
    start_ms = _ms(result["start_costs"], 0.5)
    print(
        f"relay.start()  median {start_ms:.3f} ms   "
        f"max {_ms(result['start_costs'], 1.0):.3f} ms   (first one loads the CA bundle)   "
        f"{start_ms / START_TARGET_MS:.2f}x the {START_TARGET_MS:g} ms target"
    )
    print(f"relay usage: {result['usage']}")
    paired = statistics.median(r - d for d, r in zip(direct, relayed, strict=True))
    print(f"median of paired differences: {paired * 1000:.3f} ms")


if __name__ == "__main__":
    main()
