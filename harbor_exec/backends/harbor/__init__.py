"""HarborBackend: each rollout a Docker trial of a Harbor task.

``config`` (``HarborConfig``: the one configuration every entry point builds),
``constructor`` (osmosis-ai's keywords read into it), ``resolver`` (request to task),
``planner`` (task to trial spec), ``outcomes`` (trial result to rollout outcome) and
``backend`` (their composition).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harbor_exec.backends.harbor.backend import HarborBackend
    from harbor_exec.backends.harbor.config import HarborConfig

__all__ = ["HarborBackend", "HarborConfig"]


if not TYPE_CHECKING:  # mypy sees the import above

    def __getattr__(name: str) -> Any:
        # Lazy: importing the resolver or the outcome mapping need not load the backend.
        if name == "HarborBackend":
            from harbor_exec.backends.harbor.backend import HarborBackend

            return HarborBackend
        if name == "HarborConfig":
            from harbor_exec.backends.harbor.config import HarborConfig

            return HarborConfig
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
