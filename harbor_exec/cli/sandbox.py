"""Sandbox options shared by ``serve`` and ``validate``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

import typer

from harbor_exec.sandbox.archives import OutputLimits
from harbor_exec.trial.policy import (
    DEFAULT_CPUS,
    DEFAULT_MEMORY_MB,
    DEFAULT_NOFILE_LIMIT,
    DEFAULT_SHM_MB,
    DEFAULT_STORAGE_MB,
    SandboxPolicy,
    default_pids_limit,
)


class VerifierModeChoice(StrEnum):
    """Where verifiers run: as each task says, or always in a fresh container."""

    TASK = "task"
    SEPARATE = "separate"


VerifierModeOption = Annotated[
    VerifierModeChoice,
    typer.Option(
        help="task: each task's own \\[verifier].environment_mode; separate: every verifier "
        "runs in a fresh container that sees only the artifacts (recommended for RL).",
    ),
]


class GraderVerifierModeChoice(StrEnum):
    """Where a bundled grader verifies: a fresh container, or (asked for) the agent's."""

    SEPARATE = "separate"
    SHARED = "shared"


GraderVerifierModeOption = Annotated[
    GraderVerifierModeChoice,
    typer.Option(
        help="Where a bundled grader verifies: separate (a fresh container, the default) or "
        "shared (the agent's container: weaker, the files the grader's interpreter reads "
        "besides the read-only runtime, such as /etc/ld.so.preload, are the agent's).",
    ),
]
DefaultCpusOption = Annotated[
    float, typer.Option(min=0.01, help="CPUs for tasks that set no \\[environment].cpus.")
]
DefaultMemoryOption = Annotated[
    int,
    typer.Option(
        min=16,
        help="Memory (MB) for tasks that set no \\[environment].memory_mb; never any swap.",
    ),
]
DefaultStorageOption = Annotated[
    int,
    typer.Option(
        min=16,
        help="Disk (MB) a container may write (writable layer and /logs) for tasks that set "
        "no \\[environment].storage_mb; past it the agent is stopped (DiskBudgetExceededError).",
    ),
]
DefaultShmOption = Annotated[
    int, typer.Option(min=1, help="Size (MB) of /dev/shm, at most the container's memory.")
]
DefaultNofileOption = Annotated[
    int, typer.Option(min=64, help="Open files per process in a container (nofile ulimit).")
]
DEFAULT_MAX_LOG_BYTES = OutputLimits().max_file_bytes
MaxLogBytesOption = Annotated[
    int,
    typer.Option(
        min=1024,
        help="Cap on each file copied back from a container (oracle.txt, test-stdout.txt, "
        "artifacts); the tail is kept after a marker.",
    ),
]


@dataclass(frozen=True)
class SandboxOptions:
    """The sandbox options ``serve`` and ``validate`` share, as given."""

    verifier_mode: VerifierModeChoice = VerifierModeChoice.TASK
    default_cpus: float = DEFAULT_CPUS
    default_memory_mb: int = DEFAULT_MEMORY_MB
    max_log_bytes: int = DEFAULT_MAX_LOG_BYTES
    default_storage_mb: int = DEFAULT_STORAGE_MB
    default_shm_mb: int = DEFAULT_SHM_MB
    default_nofile: int = DEFAULT_NOFILE_LIMIT
    grader_verifier_mode: GraderVerifierModeChoice = GraderVerifierModeChoice.SEPARATE

    @property
    def separate_verifier(self) -> bool:
        return self.verifier_mode is VerifierModeChoice.SEPARATE

    @property
    def shared_grader(self) -> bool:
        """The bundled grader verifies in the agent's container (asked for explicitly)."""
        return self.grader_verifier_mode is GraderVerifierModeChoice.SHARED

    @property
    def output_limits(self) -> OutputLimits:
        return OutputLimits(max_file_bytes=self.max_log_bytes)

    def policy(self, *, max_concurrent_trials: int, pid_max: int) -> SandboxPolicy:
        """The ``SandboxPolicy`` these options describe."""
        return SandboxPolicy(
            verifier_mode="separate" if self.separate_verifier else None,
            grader_verifier_mode="shared" if self.shared_grader else "separate",
            pids_limit=default_pids_limit(max_concurrent_trials, pid_max),
            default_cpus=self.default_cpus,
            default_memory_mb=self.default_memory_mb,
            default_storage_mb=self.default_storage_mb,
            shm_mb=self.default_shm_mb,
            nofile_limit=self.default_nofile,
            output=self.output_limits,
        )


__all__ = [
    "DEFAULT_CPUS",
    "DEFAULT_MAX_LOG_BYTES",
    "DEFAULT_MEMORY_MB",
    "DEFAULT_NOFILE_LIMIT",
    "DEFAULT_SHM_MB",
    "DEFAULT_STORAGE_MB",
    "DefaultCpusOption",
    "DefaultMemoryOption",
    "DefaultNofileOption",
    "DefaultShmOption",
    "DefaultStorageOption",
    "GraderVerifierModeChoice",
    "GraderVerifierModeOption",
    "MaxLogBytesOption",
    "SandboxOptions",
    "VerifierModeChoice",
    "VerifierModeOption",
]
