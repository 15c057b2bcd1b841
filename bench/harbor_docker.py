"""Harbor's own docker environment for the benches: a task environment it builds and
starts with Docker Compose, offline.

The image is built locally from a local base (no pull: ``FROM`` an image that is
present); its container has no network (``network_mode: none``) and gets tmux from
harbor-exec's read-only runtime volume, mounted as it is into our trial containers and
linked onto ``PATH``, so terminus-2 on Harbor finds the same tmux and installs nothing.

``cache_route`` gives Harbor's ``main`` the route to the package cache our trial
containers get, with no network either: it joins the network namespace of a gateway
container of ours (network ``none``, the read-only runtime's forwarder on its
``127.0.0.1:3128`` piped to a host-side egress proxy's unix socket: the build
gateway's primitive, ``harbor_exec.network.packages.build_gateway``) and gets the same
proxy variables and trust mount as our trial containers.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harbor_exec.container.exchange import RUNTIME_MOUNT, RUNTIME_TMUX
from harbor_exec.network.egress.container import proxy_env
from harbor_exec.network.packages.build_gateway import BuildGateway
from harbor_exec.network.packages.service import PackageCacheService, TrialCache
from harbor_exec.network.packages.trust import TRUST_MOUNT, trust_env
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime_volume import RuntimeContent


def compose_v2_available() -> bool:
    """Whether ``docker compose`` (v2, what Harbor's environment runs) answers."""
    docker = shutil.which("docker")
    if docker is None:
        return False
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, check=False)
    return probe.returncode == 0


def runtime_volume(runtime: DockerRuntime) -> str:
    """The read-only runtime's volume name (filled by a trial or ``images bootstrap``)."""
    return RuntimeContent.load(runtime.cache_dir).volume_name


def dockerfile(base_image: str) -> str:
    """A task's Dockerfile for both sides: ``base_image`` with the runtime's tmux linked
    onto ``PATH`` (for Harbor; harbor-exec calls the runtime's tmux by its path)."""
    return f"FROM {base_image}\nRUN ln -s {RUNTIME_TMUX} /usr/local/bin/tmux\nWORKDIR /app\n"


def write_compose_overlay(
    path: Path,
    volume: str | None,
    *,
    network_mode: str = "none",
    environment: Mapping[str, str] | None = None,
    read_only_binds: Mapping[str, str] | None = None,
) -> Path:
    """Harbor's extra compose file for its ``main`` service: ``network_mode`` (no
    network by default; ``container:<id>`` joins that container's namespace), the
    runtime volume read-only (``volume``; None: not mounted), ``environment`` and
    ``read_only_binds`` (host path -> container path). JSON, which compose reads as
    YAML, so no value needs quoting."""
    main: dict[str, Any] = {"network_mode": network_mode}
    volumes = [f"hx-runtime:{RUNTIME_MOUNT}:ro"] if volume is not None else []
    volumes += [f"{host}:{target}:ro" for host, target in (read_only_binds or {}).items()]
    if volumes:
        main["volumes"] = volumes
    if environment:
        main["environment"] = dict(environment)
    overlay: dict[str, Any] = {"services": {"main": main}}
    if volume is not None:
        overlay["volumes"] = {"hx-runtime": {"external": True, "name": volume}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(overlay, indent=2) + "\n")
    return path


def cache_overlay(path: Path, gateway_id: str, trust_dir: Path) -> Path:
    """The overlay that puts Harbor's ``main`` in the gateway's network namespace, with
    our trial containers' proxy variables and trust (read-only at ``TRUST_MOUNT``)."""
    return write_compose_overlay(
        path,
        None,
        network_mode=f"container:{gateway_id}",
        environment={**proxy_env(), **trust_env()},
        read_only_binds={str(trust_dir): TRUST_MOUNT},
    )


def network_interfaces(runtime: DockerRuntime, container_id: str) -> list[str]:
    """``/sys/class/net`` of a running container (``["lo"]``: no network but loopback)."""
    ran = runtime.exec(container_id, ["ls", "/sys/class/net"], timeout_sec=30)
    assert ran.exit_code == 0, ran.errors
    return ran.output.decode().split()


@contextmanager
def cache_route(
    runtime: DockerRuntime,
    service: PackageCacheService,
    overlay: Path,
    *,
    overrides: Mapping[str, tuple[str, int]],
    dns: bool,
) -> Iterator[tuple[TrialCache, Path]]:
    """A new cache session, a gateway whose proxy hands everything to it (HTTPS
    intercepted with the service's CA, as a trial's proxy does) and the overlay that
    routes Harbor's ``main`` through it; (session, overlay). Fails if the gateway's
    namespace has any interface but ``lo``."""
    session = service.session()
    gateway = BuildGateway(runtime, service.upstream(session), overrides=overrides, dns=dns)
    try:
        assert gateway.container_id is not None
        interfaces = network_interfaces(runtime, gateway.container_id)
        if interfaces != ["lo"]:
            raise SystemExit(f"the gateway's namespace has {interfaces}: not loopback only")
        yield session, cache_overlay(overlay, gateway.container_id, service.trust_dir)
    finally:
        gateway.close()


def remove_harbor_images(task: str) -> None:
    """The images Harbor's trials of ``task`` tagged (``task__<id>__env-<service>``:
    a trial's compose project is ``<trial name>__env``) and any ``task__...`` tag of
    the bench's own."""
    listed = subprocess.run(
        ["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}"],
        capture_output=True,
        text=True,
        check=True,
    )
    tags = [tag for tag in listed.stdout.split() if tag.startswith(f"{task}__")]
    if tags:
        subprocess.run(["docker", "image", "rm", *tags], capture_output=True, check=False)


def print_ratio(ours_label: str, ours: list[float], theirs: list[float], target: float) -> None:
    """The medians of both sides and their ratio against ``target``."""
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"{ours_label}: median {statistics.median(ours):.2f} s over {len(ours)}")
    print(f"harbor run: median {statistics.median(theirs):.2f} s over {len(theirs)}")
    verdict = "ok" if ratio <= target else "over target"
    print(f"ratio harbor-exec / Harbor: {ratio:.2f}x (target <= {target}x): {verdict}")
