"""What ``DockerRuntime`` asks the engine once and remembers (no engine needed)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.users import ImageAccounts

PASSWD = b"root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n"
GROUP = b"root:x:0:\nagent:x:1000:\n"
TRIALS = 4


def test_the_image_accounts_are_read_once_when_a_batch_starts_together() -> None:
    """A batch's first trials all start at once (``validate -n 4``): one of them reads the
    image's account files (two archive calls, the daemon's costliest kind), the others
    wait for what it read. They each read them before (eight archive calls)."""
    runtime = DockerRuntime.__new__(DockerRuntime)
    runtime._image_accounts, runtime._accounts_locks, runtime._build_locks = {}, {}, {}
    runtime._locks_guard = threading.Lock()
    reads: list[tuple[str, str]] = []
    all_reading = threading.Event()

    def read_small_file(container_id: str, path: str) -> bytes:
        reads.append((container_id, path))
        if len(reads) >= TRIALS:
            all_reading.set()
        # Long enough for every other trial to arrive here if nothing holds it back;
        # a single reader waits it out (the test's only wait, 0.2 s per file).
        all_reading.wait(0.2)
        return PASSWD if path == "/etc/passwd" else GROUP

    runtime._read_small_file = read_small_file  # type: ignore[method-assign]
    start = threading.Barrier(TRIALS)

    def trial(index: int) -> ImageAccounts:
        start.wait()
        return runtime.image_accounts("harbor-exec/env:abc", f"container-{index}")

    with ThreadPoolExecutor(TRIALS) as pool:
        accounts = list(pool.map(trial, range(TRIALS)))
    assert sorted(path for _, path in reads) == ["/etc/group", "/etc/passwd"], reads
    assert all(found is accounts[0] for found in accounts)
    assert accounts[0].resolve("agent") == "1000:1000"
    # Another image is another read.
    runtime.image_accounts("harbor-exec/env:def", "container-9")
    assert len(reads) == 4
