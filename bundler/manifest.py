"""``manifest.json``: what a bundle holds and how to run it.

The container runner reads only the refs (``workflow``, ``grader``,
``workflow_config``, ``grader_config``) and ignores the rest, so fields can be
added here without touching images that are already built.

A trial places two copies of it: the grader's, this file as written, and the
agent's, ``Manifest.agent_copy()``, which names no grader and no grader config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MANIFEST_FORMAT_VERSION", "MANIFEST_NAME", "Manifest", "WheelFile"]

MANIFEST_FORMAT_VERSION: Final = 1
MANIFEST_NAME = "manifest.json"


class WheelFile(BaseModel):
    """One wheel of the bundle, by file name (relative to its directory)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    filename: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class Manifest(BaseModel):
    """The bundle's table of contents, written as ``<bundle root>/manifest.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1] = MANIFEST_FORMAT_VERSION
    # The user's project.
    package: str
    distribution: str
    version: str
    # Entry points, each "module:attr" inside ``package``.
    workflow: str | None = None  # None: a grader-only bundle (the agent is not a workflow)
    grader: str | None = None
    workflow_config: str | None = None
    grader_config: str | None = None
    # ``wheel/<filename>``: the user's wheel, installed per trial with --no-deps.
    wheel: WheelFile
    # The user wheel's Requires-Dist that apply on the target (markers evaluated).
    requirements: list[str]
    # ``wheelhouse/<filename>``: every wheel of the dependency layer (the full install set,
    # harbor-exec's runtime, pydantic and pip included), sorted by file name.
    wheelhouse: list[WheelFile]
    runtime_wheel: str
    pip_wheel: str
    # sha256 over the sorted wheelhouse (names and hashes): keys the dependency layer.
    requirements_digest: str
    python_version: str
    platform: str
    platform_tags: list[str]
    # sha256 of every build input: keys the whole bundle (its cache directory's name).
    inputs_digest: str
    harbor_exec_version: str
    # Paths in the user wheel only the grader's copy of the bundle holds: the module files
    # of ``grader`` and ``grader_config`` (a package's directory, ending in "/"). The
    # agent's container gets the wheel without them (see bundler/split.py).
    grader_only: list[str] = Field(default_factory=list)
    # A grader ref's module is one the workflow's side imports (all in one module, as
    # osmosis-ai projects are written): the agent's part holds it too.
    grader_exposed: bool = False

    def agent_copy(self) -> Manifest:
        """The manifest as the agent's container gets it: no grader refs, no grader paths."""
        update: dict[str, object] = {
            "grader": None,
            "grader_config": None,
            "grader_only": [],
            "grader_exposed": False,
        }
        return self.model_copy(update=update)

    def in_agent_part(self, wheel_path: str) -> bool:
        """Whether the wheel's file ``wheel_path`` goes into the agent's container."""
        return not any(
            wheel_path == path or (path.endswith("/") and wheel_path.startswith(path))
            for path in self.grader_only
        )

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> Manifest:
        return cls.model_validate_json(path.read_bytes())
