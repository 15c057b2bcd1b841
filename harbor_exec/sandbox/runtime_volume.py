"""The read-only runtime: harbor-exec's own programs, mounted into every trial container.

Nothing of ours may come from the task's image: the agent can replace or shadow any
file in it (a ``sleep`` earlier on ``PATH``, a new ``/bin/sleep``, a ``python3`` of
its own), most task images have no Python at all, and whatever runs as the
container's main process survives the kill between the agent and the verifier. So
the init (tini), the keep-alive (busybox ``sleep``), the interpreter the runner and
grader run on, and its libraries come from the runtime built by
``harbor_exec.sandbox.runtime_build``, copied once per engine into a Docker named
volume that harbor-exec creates and labels, and mounted read-only at
``RUNTIME_MOUNT`` into every trial container. A named volume (not a host bind
mount) works when harbor-exec itself runs in a container. The volume is named after
the content it holds, so a new runtime gets a new volume and old ones are never
rewritten under a running trial; ``runtime.json`` is the archive's last member, so
a volume that holds it is complete.

The init and the keep-alive run as ``KEEP_ALIVE_USER``, a uid no task uses, from
execute-only files: the kernel marks them non-dumpable, so no agent, root or not,
can ptrace them or write their memory; the agent can only end them, which ends the
container (an agent-side outcome).

This module holds the plain parts (what goes in, where, under which name); the engine
calls are in ``harbor_exec.sandbox.docker``. Standard library only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from harbor_exec.container.exchange import (
    RUNTIME_BUSYBOX,
    RUNTIME_MOUNT,
    RUNTIME_PYTHON,
    RUNTIME_SETPRIV,
    RUNTIME_TINI,
)
from harbor_exec.errors import EnvironmentStartError
from harbor_exec.sandbox.apt_mirror import BootstrapError, debian_mirror
from harbor_exec.sandbox.runtime_build import (
    RUNTIME_INFO,
    RuntimeBuild,
    RuntimeBuildError,
    build_runtime,
    load_runtime_build,
    runtime_build_dir,
)

logger = logging.getLogger("harbor_exec.runtime")

#: The init's and keep-alive's own uid:gid (never a task's agent or verifier user).
KEEP_ALIVE_UID = 2147481647
KEEP_ALIVE_USER = f"{KEEP_ALIVE_UID}:{KEEP_ALIVE_UID}"
#: The container's init and main process, by absolute path into the read-only runtime,
#: so neither the first start nor a restart looks at ``PATH`` or the image's entrypoint.
#: The container itself runs as root (execs as root keep Docker's capabilities); setpriv
#: drops to ``KEEP_ALIVE_UID`` before it executes the init.
INIT_COMMAND = (
    RUNTIME_SETPRIV,
    f"--reuid={KEEP_ALIVE_UID}",
    f"--regid={KEEP_ALIVE_UID}",
    "--clear-groups",
    RUNTIME_TINI,
    "--",
)
KEEP_ALIVE_COMMAND = (RUNTIME_BUSYBOX, "sleep", "2147483647")
#: harbor-exec's own shell in the container (for its own commands, never the task's).
RUNTIME_SHELL = (RUNTIME_BUSYBOX, "sh", "-c")
#: Label on the runtime volume (besides ``LABEL_MANAGED``): the content digest.
LABEL_RUNTIME_DIGEST = "harbor-exec.runtime-digest"
RUNTIME_VOLUME_PREFIX = "harbor-exec-runtime-"
#: The file whose presence in a volume says the whole archive is in it.
RUNTIME_MARKER = f"{RUNTIME_MOUNT}/{RUNTIME_INFO}"


class RuntimeVolumeError(EnvironmentStartError):
    """The runtime is not built on this machine and could not be built: no container is
    created."""


@dataclass(frozen=True)
class RuntimeContent:
    """What the runtime volume holds (one tar archive in the cache) and its name."""

    archive: Path  # paths relative to the volume's root
    digest: str
    marker_size: int  # of runtime.json, the archive's last member

    @property
    def volume_name(self) -> str:
        return RUNTIME_VOLUME_PREFIX + self.digest[:16]

    @classmethod
    def load(cls, cache_dir: Path | None = None) -> RuntimeContent:
        """The runtime built on this machine, built now when the cache has none (the
        cache directory can be removed: every entry is rebuilt on first need)."""
        build = load_runtime_build(cache_dir)
        if build is None:
            build = _build_now(cache_dir)
        marker = (build.directory / RUNTIME_INFO).stat().st_size
        return cls(build.archive, build.digest, marker)


def _build_now(cache_dir: Path | None) -> RuntimeBuild:
    """The first trial on a machine (or after the cache was removed) builds the runtime,
    once, with progress in the log; a failure says how to build it by hand."""
    logger.warning(
        "the container runtime (harbor-exec's Python, init and keep-alive) is not built in "
        "%s yet: building it now, once (about a minute)",
        runtime_build_dir(cache_dir),
    )
    try:
        mirror, _ = debian_mirror()
        build = build_runtime(mirror, cache_dir=cache_dir, log=logger.warning)
    except (BootstrapError, RuntimeBuildError) as exc:
        raise RuntimeVolumeError(
            f"the container runtime is not built on this machine and cannot be built now: "
            f"{exc} (`harbor-exec images bootstrap`, as root, builds it ahead of time)"
        ) from exc
    return build


__all__ = [
    "INIT_COMMAND",
    "KEEP_ALIVE_COMMAND",
    "KEEP_ALIVE_UID",
    "KEEP_ALIVE_USER",
    "LABEL_RUNTIME_DIGEST",
    "RUNTIME_MARKER",
    "RUNTIME_MOUNT",
    "RUNTIME_PYTHON",
    "RUNTIME_SHELL",
    "RuntimeContent",
    "RuntimeVolumeError",
]
