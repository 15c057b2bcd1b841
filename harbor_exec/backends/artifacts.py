"""Per-rollout artifacts directories made on first use, and the workflow and grader
contexts that expose them as ``artifacts_dir`` (for ``LocalBackend``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from harbor_exec.authoring import (
    AgentWorkflowConfig,
    AgentWorkflowContext,
    GraderContext,
    RolloutSample,
)
from harbor_exec.protocol import rollout_dir_name

__all__ = ["LazyArtifactsDir", "LazyGraderContext", "LazyWorkflowContext"]

logger = logging.getLogger(__name__)


class LazyArtifactsDir:
    """``<root>/<id>/artifacts``, created the first time a workflow or grader asks for it.

    Most rollouts never write artifacts; creating two directories for each of
    them up front costs more than the rest of a trivial rollout and leaves
    millions of empty directories behind a training run. The contexts below
    expose it as the usual ``artifacts_dir`` attribute (None when it cannot
    be created).
    """

    __slots__ = ("_made", "_path", "_rollout_id", "_value")

    def __init__(self, root: Path | str, rollout_id: str) -> None:
        # Plain strings, not pathlib: on CPython 3.12 every path component that
        # pathlib parses is interned for good, one leaked string per rollout id.
        self._path = os.path.join(os.fspath(root), rollout_dir_name(rollout_id), "artifacts")
        self._rollout_id = rollout_id
        self._made = False
        self._value: Path | None = None

    def get(self) -> Path | None:
        if not self._made:
            self._made = True
            try:
                os.makedirs(self._path, exist_ok=True)
                self._value = Path(self._path)
            except OSError as exc:
                logger.warning(
                    "rollout %s: no artifacts dir at %s: %s", self._rollout_id, self._path, exc
                )
        return self._value


class _LazyArtifacts:
    """``artifacts_dir`` made on first access (most rollouts never touch it).

    Listed before the context dataclass in the bases, so this property wins
    over the dataclass field; assigning it still works.
    """

    _artifacts: LazyArtifactsDir
    _artifacts_override: tuple[Path | None] | None = None

    @property
    def artifacts_dir(self) -> Path | None:
        if self._artifacts_override is not None:
            return self._artifacts_override[0]
        return self._artifacts.get()

    @artifacts_dir.setter
    def artifacts_dir(self, value: Path | None) -> None:
        self._artifacts_override = (value,)


class LazyWorkflowContext(_LazyArtifacts, AgentWorkflowContext[Any]):
    """An ``AgentWorkflowContext`` whose ``artifacts_dir`` is made on first access."""

    def __init__(
        self,
        *,
        prompt: list[dict[str, Any]],
        config: AgentWorkflowConfig | None,
        metadata: dict[str, Any] | None,
        artifacts: LazyArtifactsDir,
    ) -> None:
        # The dataclass __init__ would assign artifacts_dir; set the fields directly.
        self.prompt = prompt
        self.config = config
        self.metadata = metadata
        self._artifacts = artifacts


class LazyGraderContext(_LazyArtifacts, GraderContext):
    """A ``GraderContext`` whose ``artifacts_dir`` is made on first access."""

    def __init__(
        self,
        *,
        label: str | None,
        sample: RolloutSample | None,
        metadata: dict[str, Any] | None,
        artifacts: LazyArtifactsDir,
    ) -> None:
        self.label = label
        self.sample = sample
        self.project_path = None
        self.metadata = metadata
        self._artifacts = artifacts
