"""Volumes are filled once per engine, across this host's processes: ``_host_lock``
(two ``validate`` runs on an empty cache once extracted the runtime over each other)."""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

from harbor_exec.sandbox.docker import HOST_LOCKS_DIR

ROOT = Path(__file__).resolve().parents[1]

HOLDER = """
import sys
from harbor_exec.sandbox.docker import _host_lock
with _host_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()  # until told to let go
print("released", flush=True)
"""


def _start(name: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, name],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _says(process: subprocess.Popen[str], within: float) -> str | None:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], within)
    return process.stdout.readline().strip() if ready else None


def test_a_second_process_waits_for_the_first() -> None:
    name = f"test-{__import__('uuid').uuid4().hex}"
    first = _start(name)
    assert _says(first, 30) == "held"
    second = _start(name)
    try:
        assert _says(second, 1.0) is None  # waits while the first holds it
        assert first.stdin is not None
        first.stdin.write("\n")
        first.stdin.flush()
        assert _says(first, 30) == "released"
        assert _says(second, 30) == "held"
        # Another name is another lock: held at once.
        other = _start(f"{name}-other")
        try:
            assert _says(other, 30) == "held"
        finally:
            other.kill()
    finally:
        for process in (first, second):
            process.kill()
            process.wait(10)
        for lock in HOST_LOCKS_DIR.glob(f"{name}*.lock"):
            lock.unlink()
