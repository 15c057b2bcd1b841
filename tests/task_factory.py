"""Writes small Harbor task directories for tests."""

from __future__ import annotations

import json
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


#: The sidecar: python's http.server answering on the task network, after writing the
#: file it serves (so that its healthcheck passes only once it serves).
SERVER = 'mkdir -p /srv && echo "$$ANSWER" > /srv/answer && exec python -m http.server 8000 -d /srv'
#: test.sh asks the sidecar by service name with bash's /dev/tcp (no curl in the image).
FETCH = """
    exec 3<>/dev/tcp/db/8000 || { echo 0 > /logs/verifier/reward.txt; exit 0; }
    printf 'GET /answer HTTP/1.0\\r\\nHost: db\\r\\n\\r\\n' >&3
    body=$(cat <&3 | tail -n 1)
    if [ "$body" = "$(cat /app/expected 2>/dev/null)" ]; then echo 1; else echo 0; fi \\
        > /logs/verifier/reward.txt
"""


def make_compose_task(
    root: Path,
    name: str,
    *,
    command: str = SERVER,
    healthcheck: bool = True,
    dockerfile: bool = True,
    solve: str = "echo 42 > /app/expected",
    extra: str = "",
    toml: str = DEFAULT_TOML,
) -> Path:
    """A compose task: ``main`` plus a ``db`` sidecar (python's http.server built from a
    local base image) that serves ``42``; the oracle writes the expected answer and
    ``test.sh`` earns 1 when the sidecar, asked by service name, answers it. ``extra``
    is appended to the ``db`` service (and may add top-level keys)."""
    task = make_task(root, name, solve=solve, test=FETCH, toml=toml)
    env = task / "environment"
    if not dockerfile:
        (env / "Dockerfile").unlink()
        (env / "main").mkdir()
        (env / "main" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (env / "db").mkdir()
    (env / "db" / "Dockerfile").write_text("FROM python:3.11-slim-bookworm\n")
    check = (
        """
    healthcheck:
      test: ["CMD", "python", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:8000/answer')"]
      interval: 1s
      timeout: 5s
      retries: 30
"""
        if healthcheck
        else ""
    )
    main_build = "" if dockerfile else "    build:\n      context: ./main\n"
    (env / "docker-compose.yaml").write_text(
        f"""services:
  main:
{main_build}    environment:
      FROM_COMPOSE: "${{MAIN_IMAGE_NAME}}"
    depends_on:
      db:
        condition: {"service_healthy" if healthcheck else "service_started"}
  db:
    build: ./db
    command: ["sh", "-c", {json.dumps(command)}]
    environment:
      ANSWER: "42"
{check}{textwrap.dedent(extra)}"""
    )
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
