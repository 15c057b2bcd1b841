"""harbor-exec: run every rollout of a Harbor task as an isolated Docker trial.

The entry points are exported here, lazily::

    from harbor_exec import HarborBackend, LocalBackend, RolloutClient, create_rollout_server
    from harbor_exec import AgentWorkflow, Grader, AgentWorkflowContext, GraderContext

Nothing is imported until a name is used: task containers import
``harbor_exec.authoring`` and ``harbor_exec.container.runner`` with only the
standard library and pydantic available, and this module must not pull in the
service (docker, FastAPI) on their way.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from harbor_exec.authoring import (
        AgentWorkflow,
        AgentWorkflowConfig,
        AgentWorkflowContext,
        Grader,
        GraderConfig,
        GraderContext,
        RolloutContext,
        RolloutErrorCategory,
        RolloutSample,
        RolloutStatus,
    )
    from harbor_exec.backends.base import ExecutionBackend
    from harbor_exec.backends.harbor import HarborBackend
    from harbor_exec.backends.local import LocalBackend
    from harbor_exec.client import RolloutClient
    from harbor_exec.server.app import create_rollout_server

# name -> the module that defines it
_EXPORTS = {
    "AgentWorkflow": "harbor_exec.authoring",
    "AgentWorkflowConfig": "harbor_exec.authoring",
    "AgentWorkflowContext": "harbor_exec.authoring",
    "Grader": "harbor_exec.authoring",
    "GraderConfig": "harbor_exec.authoring",
    "GraderContext": "harbor_exec.authoring",
    "RolloutContext": "harbor_exec.authoring",
    "RolloutErrorCategory": "harbor_exec.authoring",
    "RolloutSample": "harbor_exec.authoring",
    "RolloutStatus": "harbor_exec.authoring",
    "ExecutionBackend": "harbor_exec.backends.base",
    "HarborBackend": "harbor_exec.backends.harbor",
    "LocalBackend": "harbor_exec.backends.local",
    "RolloutClient": "harbor_exec.client",
    "create_rollout_server": "harbor_exec.server.app",
}

__all__ = [
    "AgentWorkflow",
    "AgentWorkflowConfig",
    "AgentWorkflowContext",
    "ExecutionBackend",
    "Grader",
    "GraderConfig",
    "GraderContext",
    "HarborBackend",
    "LocalBackend",
    "RolloutClient",
    "RolloutContext",
    "RolloutErrorCategory",
    "RolloutSample",
    "RolloutStatus",
    "__version__",
    "create_rollout_server",
]


if not TYPE_CHECKING:  # mypy sees the imports above; a module __getattr__ would hide typos

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'harbor_exec' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # the next lookup skips this function
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_EXPORTS})
