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


def make_multi_step_task(
    root: Path,
    name: str,
    steps: dict[str, tuple[str, str]],
    *,
    toml: str = "",
    step_tables: dict[str, str] | None = None,
    dockerfile: str = "FROM debian:bookworm-slim\nWORKDIR /app\n",
    shared_test: str | None = None,
) -> Path:
    """A multi-step task: ``steps`` maps each step's name to its (solve.sh, test.sh)
    bash snippets (a None/empty test: none of its own); ``step_tables`` adds lines to a
    step's ``[[steps]]`` table (``min_reward = 1.0``, ``[steps.agent]``...)."""
    task = root / name
    (task / "environment").mkdir(parents=True, exist_ok=True)
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    tables = []
    for step, (solve, test) in steps.items():
        step_dir = task / "steps" / step
        (step_dir / "solution").mkdir(parents=True, exist_ok=True)
        (step_dir / "instruction.md").write_text(f"Step {step}: do it.\n")
        (step_dir / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{textwrap.dedent(solve)}\n")
        if test:
            (step_dir / "tests").mkdir(exist_ok=True)
            (step_dir / "tests" / "test.sh").write_text(f"#!/bin/bash\n{textwrap.dedent(test)}\n")
        extra = textwrap.dedent((step_tables or {}).get(step, ""))
        tables.append(f'[[steps]]\nname = "{step}"\n{extra}\n')
    if shared_test is not None:
        (task / "tests").mkdir(exist_ok=True)
        (task / "tests" / "test.sh").write_text(f"#!/bin/bash\n{textwrap.dedent(shared_test)}\n")
    (task / "task.toml").write_text(textwrap.dedent(toml) + "\n" + "\n".join(tables))
    return task
