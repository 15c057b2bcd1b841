"""HTTP round trip of a trivial graded rollout: harbor-exec vs the osmosis-ai 0.3.8 server.

Each server runs in its own process on 127.0.0.1 (uvicorn, same settings,
``LocalBackend`` with its default concurrency and a temporary artifact root);
this process drives it with the matching client at each concurrency level and
reads the server's CPU time from ``/proc/<pid>/stat`` and its own (the client's)
from ``time.process_time()``. It prints rollouts per second, server CPU and
client CPU milliseconds per rollout for both, and the ratios (targets: >= 2x the
throughput, <= 0.4x the server CPU and <= 0.5x the client CPU per rollout).
Both servers run uvicorn with the same settings, on uvloop and httptools as
``harbor-exec serve`` does (``--pure-python``: asyncio's loop and h11 for both).

Both servers stay up and the rounds alternate between them, so load from
elsewhere on the machine hits both alike; the summary shows medians. Every
round is bounded: at most ``--rollouts`` rollouts and ``--time-limit`` seconds.

    .venv/bin/python bench/bench_http.py
    .venv/bin/python bench/bench_http.py --rollouts 2000 --rounds 5 --concurrency 1,32

``--console-poll`` measures something else: harbor-exec's server alone, its rounds
alternating between plain ones and ones during which this process asks the live console's
data (``GET /console/data``) every 2 s, as an open console page does; it reports rollouts
per second and server CPU per rollout with the console over without, as ratios (target:
within 5%, 0.95x-1.05x; the server's CPU answering the console counts in "with").

    .venv/bin/python bench/bench_http.py --console-poll --rounds 5

``--with-osmosis-backend`` adds a third server: osmosis-ai's own LocalBackend object (the
same trivial SDK workflow and grader) behind harbor-exec's server
(``harbor_exec.backends.osmosis``), driven by osmosis-ai's client, and reports it against
the osmosis-ai server: what serving an unchanged osmosis-ai backend with us costs or saves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT = [{"role": "user", "content": "What is 2+2?"}]
CHAT_URL = "http://127.0.0.1:9/v1/chat/completions"
IMPLEMENTATIONS = ("harbor-exec", "osmosis-ai")
# osmosis-ai's LocalBackend object behind harbor-exec's server (``--with-osmosis-backend``).
OSMOSIS_BEHIND_OURS = "osmosis-backend"
# harbor-exec's server while its console's data is asked every 2 s (``--console-poll``).
WITH_CONSOLE = "harbor-exec+console"
CONSOLE_POLL_SEC = 2.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------- server side


def _harbor_exec_app(artifact_root: str) -> Any:
    from harbor_exec.authoring import (
        AgentWorkflow,
        AgentWorkflowConfig,
        AgentWorkflowContext,
        Grader,
        GraderContext,
    )
    from harbor_exec.backends.local import LocalBackend
    from harbor_exec.server import create_rollout_server

    class Answer(AgentWorkflow[AgentWorkflowConfig]):
        async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
            return [*ctx.prompt, {"role": "assistant", "content": "4"}]

    class Exact(Grader):
        async def grade(self, ctx: GraderContext) -> None:
            assert ctx.sample is not None
            ctx.set_reward(1.0 if ctx.sample.messages[-1]["content"] == ctx.label else 0.0)

    backend = LocalBackend(workflow=Answer, grader=Exact, artifact_root=artifact_root)
    # The database on, as `harbor-exec serve` runs it (--data-dir), unless
    # HARBOR_EXEC_BENCH_NO_DATA_DIR=1 (to measure what it costs).
    no_db = os.environ.get("HARBOR_EXEC_BENCH_NO_DATA_DIR") == "1"
    return create_rollout_server(
        backend=backend,
        artifact_root=artifact_root,
        data_dir=None if no_db else os.path.join(artifact_root, ".data-dir"),
    )


def _osmosis_backend(artifact_root: str) -> Any:
    os.environ["_OSMOSIS_ROLLOUT_ARTIFACT_ROOT"] = artifact_root
    from osmosis_ai.rollout import AgentWorkflow, Grader
    from osmosis_ai.rollout.backend.local import LocalBackend

    class Answer(AgentWorkflow):  # type: ignore[type-arg]
        async def run(self, ctx: Any) -> Any:
            return [*ctx.prompt, {"role": "assistant", "content": "4"}]

    class Exact(Grader):
        async def grade(self, ctx: Any) -> None:
            ctx.set_reward(1.0 if ctx.sample.messages[-1]["content"] == ctx.label else 0.0)

    return LocalBackend(workflow=Answer, grader=Exact)


def _osmosis_app(artifact_root: str) -> Any:
    from osmosis_ai.rollout.server import create_rollout_server

    return create_rollout_server(backend=_osmosis_backend(artifact_root))


def _osmosis_behind_ours_app(artifact_root: str) -> Any:
    from harbor_exec.server import create_rollout_server

    no_db = os.environ.get("HARBOR_EXEC_BENCH_NO_DATA_DIR") == "1"
    return create_rollout_server(
        backend=_osmosis_backend(artifact_root),
        artifact_root=artifact_root,
        data_dir=None if no_db else os.path.join(artifact_root, ".data-dir"),
    )


def serve(implementation: str, artifact_root: str, pure_python: bool) -> None:
    """Server process: print the port, then serve until SIGTERM."""
    import uvicorn

    from harbor_exec.server.run import uvicorn_implementations

    builders = {
        "harbor-exec": _harbor_exec_app,
        "osmosis-ai": _osmosis_app,
        OSMOSIS_BEHIND_OURS: _osmosis_behind_ours_app,
    }
    app = builders[implementation](artifact_root)
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on sockets whose proto
    # says TCP, and without it every response waits out a delayed ACK (~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    loop, http = ("asyncio", "h11") if pure_python else uvicorn_implementations()
    config = uvicorn.Config(
        app,
        loop=loop,
        http=http,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(config).run(sockets=[sock])


# ---------------------------------------------------------------------------- driver side


@dataclass
class Measurement:
    implementation: str
    concurrency: int
    rollouts: int
    wall_sec: float
    server_cpu_sec: float
    client_cpu_sec: float

    @property
    def per_second(self) -> float:
        return self.rollouts / self.wall_sec

    @property
    def cpu_ms(self) -> float:
        return self.server_cpu_sec * 1000 / self.rollouts

    @property
    def client_cpu_ms(self) -> float:
        return self.client_cpu_sec * 1000 / self.rollouts


def _process_cpu_sec(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of stat; index 11/12 after the name.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _client(implementation: str, url: str) -> Any:
    """Each client with its default HTTP stack (ours: aiohttp; osmosis-ai: httpx)."""
    if implementation == "harbor-exec":
        from harbor_exec.client import RolloutClient

        return RolloutClient(url=url, admission_timeout_sec=60)
    from osmosis_ai.rollout.client import RolloutClient as OsmosisClient

    return OsmosisClient(url=url, admission_timeout_sec=60)


class _ConsolePoller:
    """Asks ``GET /console/data`` every ``CONSOLE_POLL_SEC`` on a thread (as an open
    console page does), from ``start()`` to ``stop()``; counts its answers."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self._stop.is_set():
                answer = http.get("/console/data")
                if answer.status_code != 200:
                    raise RuntimeError(f"console data: {answer.status_code}")
                self.polls += 1
                self._stop.wait(CONSOLE_POLL_SEC)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=15)
        return self.polls


async def _drive(
    implementation: str,
    url: str,
    pid: int,
    concurrency: int,
    count: int,
    time_limit: float,
    warmup: int,
    poll_console: bool = False,
) -> Measurement:
    client = _client("harbor-exec" if implementation == WITH_CONSOLE else implementation, url)
    poller = _ConsolePoller(url) if poll_console else None
    try:
        issued = completed = 0
        target = warmup
        deadline = time.monotonic() + time_limit

        async def worker() -> None:
            nonlocal issued, completed
            while issued < target and time.monotonic() < deadline:
                issued += 1
                result = await client.run_rollout(PROMPT, CHAT_URL, uuid.uuid4().hex, label="4")
                if (
                    result.status != "success"
                    or result.sample is None
                    or result.sample.reward != 1.0
                ):
                    raise RuntimeError(f"unexpected result: {result}")
                completed += 1

        # Warm-up (connections, caches), not measured.
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        issued = completed = 0
        target = count
        cpu_before = _process_cpu_sec(pid)
        client_before = time.process_time()
        started = time.monotonic()
        deadline = started + time_limit
        if poller is not None:
            poller.start()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - started
        cpu = _process_cpu_sec(pid) - cpu_before
        client_cpu = time.process_time() - client_before
    finally:
        if poller is not None and poller.stop() == 0:
            raise RuntimeError("the console's data was never answered")
        await client.aclose()
    return Measurement(implementation, concurrency, completed, wall, cpu, client_cpu)


def _start_server(
    implementation: str, artifact_root: str, pure_python: bool = False
) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, __file__, "--serve", implementation, "--artifact-root"]
    process = subprocess.Popen(
        [*command, artifact_root, *(["--pure-python"] if pure_python else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    port = process.stdout.readline().strip()
    if not port:
        process.kill()
        raise RuntimeError(f"{implementation} server did not start")
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{implementation} server never became healthy")
        time.sleep(0.05)


def _stop_server(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


def _osmosis_available() -> bool:
    try:
        import osmosis_ai.rollout.client
        import osmosis_ai.rollout.server  # noqa: F401
    except ImportError:
        return False
    return True


def run(
    concurrencies: list[int],
    count: int,
    time_limit: float,
    rounds: int,
    pure_python: bool = False,
    with_osmosis_backend: bool = False,
) -> list[Measurement]:
    """All servers stay up; rounds alternate between them so that load from
    elsewhere on the machine hits them alike."""
    implementations = [
        impl for impl in IMPLEMENTATIONS if impl == "harbor-exec" or _osmosis_available()
    ]
    if with_osmosis_backend and _osmosis_available():
        implementations.append(OSMOSIS_BEHIND_OURS)
    results: list[Measurement] = []
    with contextlib.ExitStack() as stack:
        servers: dict[str, tuple[subprocess.Popen[str], str]] = {}
        for implementation in implementations:
            root = stack.enter_context(
                tempfile.TemporaryDirectory(prefix=f"bench-{implementation}-")
            )
            servers[implementation] = _start_server(implementation, root, pure_python)
            stack.callback(_stop_server, servers[implementation][0])
            # First contact: imports, caches, connection setup.
            process, url = servers[implementation]
            asyncio.run(_drive(implementation, url, process.pid, 4, 0, time_limit, warmup=200))
        for concurrency in concurrencies:
            for round_index in range(rounds):
                for implementation in implementations:
                    process, url = servers[implementation]
                    measurement = asyncio.run(
                        _drive(
                            implementation,
                            url,
                            process.pid,
                            concurrency,
                            count,
                            time_limit,
                            warmup=2 * concurrency,
                        )
                    )
                    results.append(measurement)
                    print(
                        f"round {round_index + 1}  {implementation:>15}  c={concurrency:<3}"
                        f" {measurement.rollouts:>6} rollouts"
                        f"  {measurement.per_second:8.1f} rollouts/s"
                        f"  {measurement.cpu_ms:6.3f} ms server CPU/rollout"
                        f"  ({measurement.client_cpu_ms:.3f} ms client CPU)",
                        flush=True,
                    )
    return results


def run_console(
    concurrencies: list[int], count: int, time_limit: float, rounds: int, pure_python: bool
) -> list[Measurement]:
    """One harbor-exec server; at each level its rounds alternate between plain ones and
    ones with the console's data asked every 2 s (which of the two goes first alternates
    too), so that load from elsewhere hits both alike."""
    results: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="bench-console-") as root:
        process, url = _start_server("harbor-exec", root, pure_python)
        try:
            asyncio.run(_drive("harbor-exec", url, process.pid, 4, 0, time_limit, warmup=200))
            for concurrency in concurrencies:
                for round_index in range(rounds):
                    order = ["harbor-exec", WITH_CONSOLE]
                    if round_index % 2:
                        order.reverse()
                    for label in order:
                        measurement = asyncio.run(
                            _drive(
                                label, url, process.pid, concurrency, count, time_limit,
                                warmup=2 * concurrency, poll_console=label == WITH_CONSOLE,
                            )
                        )  # fmt: skip
                        results.append(measurement)
                        print(
                            f"round {round_index + 1}  {label:>19}  c={concurrency:<3}"
                            f" {measurement.rollouts:>6} rollouts"
                            f"  {measurement.per_second:8.1f} rollouts/s"
                            f"  {measurement.cpu_ms:6.3f} ms server CPU/rollout",
                            flush=True,
                        )
        finally:
            _stop_server(process)
    return results


def report_console(results: list[Measurement]) -> None:
    """Medians over the rounds (with their range), with the console over without."""
    levels = sorted({m.concurrency for m in results})
    print()
    print("medians over rounds [min-max]; server CPU in ms per rollout")
    for level in levels:
        plain = [m for m in results if (m.implementation, m.concurrency) == ("harbor-exec", level)]
        polled = [m for m in results if (m.implementation, m.concurrency) == (WITH_CONSOLE, level)]
        for label, value in (
            ("rollouts/s", lambda m: m.per_second),
            ("server CPU", lambda m: m.cpu_ms),
        ):
            without = [value(m) for m in plain]
            with_console = [value(m) for m in polled]
            base, other = statistics.median(without), statistics.median(with_console)
            print(
                f"c={level:<3} {label:<10}  without {base:8.3f} [{_spread(without)}]"
                f"  with console {other:8.3f} [{_spread(with_console)}]  {other / base:5.3f}x"
            )
    print("target: with/without within 0.95x-1.05x (rollouts/s and server CPU per rollout)")


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def report(results: list[Measurement]) -> None:
    """Medians over the rounds (with their range), and ours/reference ratios."""
    levels = sorted({m.concurrency for m in results})
    runs = {
        (implementation, level): [
            m for m in results if (m.implementation, m.concurrency) == (implementation, level)
        ]
        for implementation in (*IMPLEMENTATIONS, OSMOSIS_BEHIND_OURS)
        for level in levels
    }
    print()
    print("medians over rounds [min-max]; CPU in ms per rollout")
    for level in levels:
        ours = runs["harbor-exec", level]
        ref = runs["osmosis-ai", level]
        for label, value in (
            ("rollouts/s", lambda m: m.per_second),
            ("server CPU", lambda m: m.cpu_ms),
            ("client CPU", lambda m: m.client_cpu_ms),
        ):
            mine = [value(m) for m in ours]
            median = statistics.median(mine)
            line = f"c={level:<3} {label:<10}  ours {median:8.3f} [{_spread(mine)}]"
            if ref:
                theirs = [value(m) for m in ref]
                reference = statistics.median(theirs)
                line += f"  ref {reference:8.3f} [{_spread(theirs)}]  {median / reference:5.2f}x"
            print(line)
            behind = [value(m) for m in runs[OSMOSIS_BEHIND_OURS, level]]
            if behind and ref:
                served = statistics.median(behind)
                print(
                    f"      {'':<10}  osmosis-ai LocalBackend behind ours {served:8.3f}"
                    f" [{_spread(behind)}]  {served / reference:5.2f}x the osmosis-ai server"
                )
    print("targets: rollouts/s ratio >= 2.00x, server CPU ratio <= 0.40x, client CPU <= 0.50x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--serve", choices=(*IMPLEMENTATIONS, OSMOSIS_BEHIND_OURS), help=argparse.SUPPRESS
    )
    parser.add_argument("--artifact-root", help=argparse.SUPPRESS)
    parser.add_argument("--rollouts", type=int, default=1000, help="rollouts per round (max)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per round (max)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per level")
    parser.add_argument("--concurrency", default="1,32", help="comma-separated levels")
    parser.add_argument(
        "--pure-python", action="store_true", help="asyncio's loop and h11 for both servers"
    )
    parser.add_argument(
        "--console-poll",
        action="store_true",
        help="harbor-exec alone, with vs without GET /console/data every 2 s (ratios)",
    )
    parser.add_argument(
        "--with-osmosis-backend",
        action="store_true",
        help="also serve osmosis-ai's LocalBackend object with harbor-exec's server",
    )
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.artifact_root, args.pure_python)
        return
    levels = [int(level) for level in args.concurrency.split(",")]
    if args.console_poll:
        report_console(
            run_console(levels, args.rollouts, args.time_limit, args.rounds, args.pure_python)
        )
        return
    results = run(
        levels,
        args.rollouts,
        args.time_limit,
        args.rounds,
        args.pure_python,
        args.with_osmosis_backend,
    )
    report(results)


if __name__ == "__main__":
    main()
