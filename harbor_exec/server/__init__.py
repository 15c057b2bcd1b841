"""The rollout HTTP server (FastAPI): ``create_rollout_server(backend=...)``."""

from harbor_exec.server.app import create_rollout_server
from harbor_exec.server.run import serve_app

__all__ = ["create_rollout_server", "serve_app"]
