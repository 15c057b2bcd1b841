"""The server of tests/test_server_memory.py, in a process of its own.

``python -m tests.memory_server ARTIFACT_ROOT LEASE_SEC RETENTION_SEC KEEP_ALIVE_SEC``
serves our rollout server (LocalBackend) on 127.0.0.1, prints its URL, and serves
until its stdin closes. ``GET /_probe`` reports what the test measures in this
process: whether every rollout is let go, the registry's size, the admitted count
and, with ``?settle=1``, the interpreter's allocated blocks after a collection.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from tests.server_utils import UNLIMITED, ServerThread, local_app


def build(artifact_root: Path, lease_sec: float, retention_sec: float) -> FastAPI:
    app: FastAPI = local_app(
        artifact_root,
        workflow_config=UNLIMITED,
        result_wait_timeout_sec=1.0,
        polling_lease_timeout_sec=lease_sec,
        result_retention_sec=retention_sec,
    )
    service = app.state.rollout_service
    registry = service.registry

    @app.get("/_probe", include_in_schema=False)
    def probe(settle: bool = False) -> dict[str, Any]:
        drained = (
            not registry.entries
            and not registry._lease_heap
            and not registry._retained
            and not service.tasks
            and service.writer.flush(0)
        )
        blocks = None
        if settle:
            gc.collect()
            blocks = sys.getallocatedblocks()
        return {
            "drained": drained,
            "entries": len(registry.entries),
            "admitted": service.metrics.admitted,
            "blocks": blocks,
        }

    return app


def main() -> None:
    root, lease, retention, keep_alive = sys.argv[1:5]
    server = ServerThread(build(Path(root), float(lease), float(retention)),
                          keep_alive_sec=float(keep_alive))  # fmt: skip
    print(server.start(), flush=True)
    sys.stdin.read()  # until the test closes it
    server.stop()


if __name__ == "__main__":
    main()
