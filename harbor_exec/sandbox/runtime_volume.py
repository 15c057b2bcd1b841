"""The read-only runtime: harbor-exec's own programs, mounted into every trial container.

Nothing of ours may come from the task's image: the agent can replace or shadow any
file in it (a ``sleep`` earlier on ``PATH``, a new ``/bin/sleep``), and whatever runs
as the container's main process survives the kill between the agent and the verifier.
So the keep-alive is a static busybox (Debian's ``busybox-static``: no libc needed,
any image works) copied once per engine into a Docker named volume that harbor-exec
creates and labels, and mounted read-only at ``RUNTIME_MOUNT`` into every trial
container. A named volume (not a host bind mount) works when harbor-exec itself runs
in a container. The volume is named after the content it holds, so a new busybox gets
a new volume and old ones are never rewritten under a running trial.

This module holds the plain parts (what goes in, where, under which name); the engine
calls are in ``harbor_exec.sandbox.docker``. Standard library only.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from harbor_exec.errors import EnvironmentStartError

#: Where the runtime is mounted (read-only) in every trial container.
RUNTIME_MOUNT = "/opt/harbor-exec-runtime"
KEEP_ALIVE_BINARY = f"{RUNTIME_MOUNT}/bin/busybox"
#: The container's main process, under Docker's init: by absolute path into the
#: read-only runtime, so neither the first start nor a restart looks at ``PATH``.
KEEP_ALIVE_COMMAND = (KEEP_ALIVE_BINARY, "sleep", "2147483647")
#: Where Debian's ``busybox-static`` installs its binary.
BUSYBOX_SOURCE = Path("/bin/busybox")
BUSYBOX_PACKAGE = "busybox-static"
#: The operator's choice of another static busybox.
BUSYBOX_ENV = "HARBOR_EXEC_BUSYBOX"
#: Label on the runtime volume (besides ``LABEL_MANAGED``): the content digest.
LABEL_RUNTIME_DIGEST = "harbor-exec.runtime-digest"
RUNTIME_VOLUME_PREFIX = "harbor-exec-runtime-"


class RuntimeVolumeError(EnvironmentStartError):
    """The runtime's content (the static busybox) is missing: no container is created."""


@dataclass(frozen=True)
class RuntimeContent:
    """What the runtime volume holds, as one tar archive, and the name it gets."""

    archive: bytes  # paths relative to the volume's root
    digest: str  # of the busybox
    size: int  # of the busybox

    @property
    def volume_name(self) -> str:
        return RUNTIME_VOLUME_PREFIX + self.digest[:16]

    @classmethod
    def load(cls, busybox: Path | str | None = None) -> RuntimeContent:
        """Read the static busybox (``busybox``, ``$HARBOR_EXEC_BUSYBOX`` or Debian's)."""
        path = Path(busybox or os.environ.get(BUSYBOX_ENV) or BUSYBOX_SOURCE)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise RuntimeVolumeError(
                f"cannot read the keep-alive's static busybox {path} ({exc.strerror or exc}): "
                f"install Debian's {BUSYBOX_PACKAGE} (scripts/setup.sh does), or set "
                f"${BUSYBOX_ENV} to a statically linked busybox"
            ) from None
        if data[:4] != b"\x7fELF":
            raise RuntimeVolumeError(f"{path} is not an ELF executable (want a static busybox)")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for directory in ("bin",):
                info = tarfile.TarInfo(directory)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            info = tarfile.TarInfo("bin/busybox")
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
        return cls(buffer.getvalue(), hashlib.sha256(data).hexdigest(), len(data))


__all__ = [
    "BUSYBOX_ENV",
    "BUSYBOX_PACKAGE",
    "KEEP_ALIVE_BINARY",
    "KEEP_ALIVE_COMMAND",
    "LABEL_RUNTIME_DIGEST",
    "RUNTIME_MOUNT",
    "RuntimeContent",
    "RuntimeVolumeError",
]
