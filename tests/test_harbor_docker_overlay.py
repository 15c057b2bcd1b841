"""The compose overlays the benches hand Harbor (``bench/harbor_docker.py``): what its
``main`` service gets (JSON, which compose reads as YAML)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.harbor_docker import cache_overlay, write_compose_overlay
from harbor_exec.container.exchange import RUNTIME_MOUNT
from harbor_exec.network.egress.container import EGRESS_PROXY_URL
from harbor_exec.network.packages.trust import TRUST_MOUNT, trust_env


def _load(path: Path) -> dict[str, Any]:
    loaded = json.loads(path.read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_cache_overlay_joins_the_gateway_with_proxy_and_trust(tmp_path: Path) -> None:
    trust = tmp_path / "trust dir"  # a space: kept as one value
    overlay = _load(cache_overlay(tmp_path / "o.json", "abc123", trust))
    assert list(overlay) == ["services"]  # no networks, no volumes of its own
    services = overlay["services"]
    assert isinstance(services, dict) and list(services) == ["main"]
    main = services["main"]
    assert main["network_mode"] == "container:abc123"
    assert "networks" not in main and "ports" not in main and "extra_hosts" not in main
    assert main["volumes"] == [f"{trust}:{TRUST_MOUNT}:ro"]
    env = main["environment"]
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert env[name] == EGRESS_PROXY_URL == "http://127.0.0.1:3128"
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,127.0.0.1,::1"
    for name, value in trust_env().items():
        assert env[name] == value and value.startswith(TRUST_MOUNT + "/")
    # Only loopback addresses anywhere in the overlay.
    text = (tmp_path / "o.json").read_text()
    for prefix in ("172.", "10.", "192.168.", "0.0.0.0", "host-gateway"):
        assert prefix not in text


def test_default_overlay_has_no_network_and_the_runtime_read_only(tmp_path: Path) -> None:
    overlay = _load(write_compose_overlay(tmp_path / "o.yaml", "hx-runtime-vol"))
    main = overlay["services"]["main"]
    assert main == {"network_mode": "none", "volumes": [f"hx-runtime:{RUNTIME_MOUNT}:ro"]}
    assert overlay["volumes"] == {"hx-runtime": {"external": True, "name": "hx-runtime-vol"}}
