"""Harbor's own docker environment for the benches: a task environment it builds and
starts with Docker Compose, offline.

The image is built locally from a local base (no pull: ``FROM`` an image that is
present); its container has no network (``network_mode: none``) and gets tmux from
harbor-exec's read-only runtime volume, mounted as it is into our trial containers and
linked onto ``PATH``, so terminus-2 on Harbor finds the same tmux and installs nothing.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
from pathlib import Path

from harbor_exec.container.exchange import RUNTIME_MOUNT, RUNTIME_TMUX
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


def write_compose_overlay(path: Path, volume: str) -> Path:
    """Harbor's extra compose file: no network, the runtime volume read-only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "services:\n"
        "  main:\n"
        "    network_mode: none\n"
        "    volumes:\n"
        f"      - hx-runtime:{RUNTIME_MOUNT}:ro\n"
        "volumes:\n"
        "  hx-runtime:\n"
        "    external: true\n"
        f"    name: {volume}\n"
    )
    return path


def remove_harbor_images(task: str) -> None:
    """The images Harbor's trials of ``task`` tagged (``task__<id>__env-<service>``)."""
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
