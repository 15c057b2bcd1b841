"""The rollout HTTP server (FastAPI): ``create_rollout_server(backend=...)``.

``app`` (the routes), ``service`` (admission, leases, long-polls), ``http`` (request
and response helpers), ``results`` (wire bodies of results), ``openapi`` (what
``/openapi.json`` says, from ``harbor_exec.protocol``), ``registry`` (rollouts in
memory), ``store`` (their durable copy), ``trajectory``, ``metrics``, ``run`` (uvicorn).
"""

from harbor_exec.server.app import create_rollout_server
from harbor_exec.server.run import serve_app

__all__ = ["create_rollout_server", "serve_app"]
