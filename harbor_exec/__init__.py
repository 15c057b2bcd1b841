"""harbor-exec: run every rollout of a Harbor task as an isolated Docker trial.

This top-level module stays import-light: task containers import
``harbor_exec.authoring`` and ``harbor_exec.runner`` with only the standard
library and pydantic available.
"""

__version__ = "0.1.0"
