"""The rollout HTTP server (FastAPI): ``create_rollout_server(backend=...)``."""

from harbor_exec.server.app import create_rollout_server

__all__ = ["create_rollout_server"]
