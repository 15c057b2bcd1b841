"""HarborBackend: each rollout a Docker trial of a Harbor task.

``resolver`` (request to task), ``planner`` (task to trial spec), ``outcomes``
(trial result to rollout outcome) and ``backend`` (their composition).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harbor_exec.backends.harbor.backend import HarborBackend

__all__ = ["HarborBackend"]


if not TYPE_CHECKING:  # mypy sees the import above

    def __getattr__(name: str) -> Any:
        # Lazy: importing the resolver or the outcome mapping need not load the backend.
        if name == "HarborBackend":
            from harbor_exec.backends.harbor.backend import HarborBackend

            return HarborBackend
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
