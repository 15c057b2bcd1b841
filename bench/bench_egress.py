"""Throughput and per-request cost of the allowlist egress path on loopback.

A local HTTP server (``tests/test_egress.py``'s) on 127.0.0.1, reached by httpx
directly and through the path a container uses: the forwarder on a loopback port,
piped to an ``EgressProxy`` on a unix socket, whose override maps ``b.test`` to
the server. Prints the best of three 50 MB downloads each way and the mean of 200
small GETs on one kept-alive connection each way.

    .venv/bin/python -m bench.bench_egress
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from harbor_exec.container.forward import ForwarderThread
from harbor_exec.network.egress.policy import EgressPolicy
from harbor_exec.network.egress.proxy import EgressProxy, EgressProxyThread
from tests.test_egress import _Server

SIZE = 50_000_000


def best_of(fn: Callable[[], Any], runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        begin = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - begin)
    return best


def main() -> None:
    server = _Server("bench")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    scratch = Path(tempfile.mkdtemp(prefix="hx-bench-egress-"))
    proxy = EgressProxy(
        directory=scratch / "e",
        trial="bench",
        overrides={"b.test": ("127.0.0.1", server.port)},
        dns=False,
    )
    thread = EgressProxyThread(proxy)
    thread.start()
    thread.set_phase("agent", EgressPolicy.allowlist("b.test"))
    forwarder = ForwarderThread(str(proxy.socket_path))
    port = forwarder.start()
    direct_url = f"http://127.0.0.1:{server.port}"
    try:
        with (
            httpx.Client(trust_env=False, timeout=60) as direct,
            httpx.Client(proxy=f"http://127.0.0.1:{port}", trust_env=False, timeout=60) as via,
        ):
            big_direct = best_of(lambda: direct.get(f"{direct_url}/bytes/{SIZE}").content)
            big_via = best_of(lambda: via.get(f"http://b.test/bytes/{SIZE}").content)
            small_direct = best_of(lambda: [direct.get(f"{direct_url}/x") for _ in range(200)], 2)
            small_via = best_of(lambda: [via.get("http://b.test/x") for _ in range(200)], 2)
    finally:
        forwarder.close()
        thread.close()
        server.shutdown()
        server.server_close()
    print(
        f"50 MB: direct {big_direct:.2f} s ({SIZE / big_direct / 1e6:.0f} MB/s), "
        f"through the egress path {big_via:.2f} s ({SIZE / big_via / 1e6:.0f} MB/s)"
    )
    print(
        f"small GET (mean of 200): direct {small_direct * 5:.2f} ms, "
        f"through the egress path {small_via * 5:.2f} ms"
    )


if __name__ == "__main__":
    main()
