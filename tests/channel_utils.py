"""Containers with and without the command channel, side by side (engine tests only)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import ContainerSpec

IMAGE = "python:3.11-slim-bookworm"


def probe_spec(prefix: str, channel: bool, **fields: Any) -> ContainerSpec:
    """A small container of ``IMAGE`` (512 MB, 256 pids unless ``fields`` say)."""
    return ContainerSpec(
        **{
            "image": IMAGE,
            "name": f"{prefix}-{'on' if channel else 'off'}-{time.time_ns() % 10**9}",
            "labels": {},
            "command_channel": channel,
            "memory_mb": 512,
            "pids_limit": 256,
            **fields,
        }
    )


@contextlib.contextmanager
def channel_pair(
    runtime: DockerRuntime, prefix: str, setup: str = "true", **fields: Any
) -> Iterator[dict[str, Any]]:
    """Two started containers of one spec, ``"on"`` with the channel and ``"off"``
    without, ``setup`` run in each (their first command: the channel's server has said
    hello); removed after."""
    created: dict[str, Any] = {"runtime": runtime}
    try:
        for channel in (True, False):
            container = runtime.create(probe_spec(prefix, channel, **fields))
            created["on" if channel else "off"] = container
            runtime.start(container)
            ran = runtime.exec(container, ["sh", "-c", setup])
            assert ran.exit_code == 0, ran
        yield created
    finally:
        for key in ("on", "off"):
            if key in created:
                runtime.remove(created[key])
