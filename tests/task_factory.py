"""Writes small Harbor task directories for tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

DEFAULT_TOML = """
[agent]
timeout_sec = 30.0

[verifier]
timeout_sec = 30.0
"""


def make_task(
    root: Path,
    name: str,
    *,
    solve: str = "true",
    test: str = "echo 1 > /logs/verifier/reward.txt",
    toml: str = DEFAULT_TOML,
    dockerfile: str = "FROM debian:bookworm-slim\nWORKDIR /app\n",
    instruction: str = "Do the thing.\n",
) -> Path:
    """A task dir whose solve.sh and test.sh run the given bash snippets."""
    task = root / name
    for sub in ("environment", "solution", "tests"):
        (task / sub).mkdir(parents=True, exist_ok=True)
    (task / "instruction.md").write_text(instruction)
    (task / "task.toml").write_text(textwrap.dedent(toml))
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{textwrap.dedent(solve)}\n")
    (task / "tests" / "test.sh").write_text(f"#!/bin/bash\n{textwrap.dedent(test)}\n")
    return task
