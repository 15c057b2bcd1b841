"""One way for tests to run the ``harbor-exec`` command: in this process, or as a user would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from harbor_exec.cli.app import app  # every command registered by name

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "harbor_exec.cli"]


@dataclass
class CliResult:
    exit_code: int
    output: str  # its words, one space apart: rich's wrapping and box drawing taken out


def invoke(*args: str, env: dict[str, str | None] | None = None) -> CliResult:
    """The CLI in this process, with no engine to reach and no package source set."""
    base: dict[str, str | None] = {
        "DOCKER_HOST": "unix:///nonexistent",
        "HARBOR_EXEC_PACKAGE_SOURCE": None,
        "COLUMNS": "1000",
    }
    result = CliRunner().invoke(app, list(args), env={**base, **(env or {})}, terminal_width=1000)
    return CliResult(result.exit_code, " ".join(re.sub(r"[│╭╮╰╯─]+", " ", result.output).split()))


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``harbor-exec ARGS`` in a subprocess, on this checkout's harbor_exec."""
    full = {
        **os.environ,
        "COLUMNS": "1000",
        "NO_COLOR": "1",
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    full.pop("HARBOR_EXEC_PACKAGE_SOURCE", None)
    return subprocess.run(
        [*CLI, *args], cwd=cwd, capture_output=True, text=True, env=full, timeout=timeout
    )
