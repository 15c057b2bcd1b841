"""The bundle's dependency environment: its wheelhouse, installed once per requirement set.

A bundle's third-party wheels (and harbor-exec's container side, and pydantic) are
installed with the runtime's own Python (``harbor_exec.sandbox.runtime_volume``) into
a named volume of their own, keyed by the requirement set's digest alone, and mounted
read-only at ``DEPS_MOUNT`` into every trial that runs the bundle: nothing is built
FROM the task image, so a dataset of a thousand tasks that share a requirement set
installs it once. The runtime's site-packages name ``DEPS_SITE`` in a ``.pth`` file,
so the runner finds it under ``python -I`` too.

A plain value (``DepsLayer``) says what to install; ``ensure_deps_env`` fills the
volume on whichever engine runs the trial (this machine's, or a Ray node's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harbor_exec.container.exchange import DEPS_MOUNT, DEPS_SITE, RUNTIME_PYTHON
from harbor_exec.sandbox.runtime import LABEL_KIND, ContainerRuntime, VolumeFill

DEPS_BUILD_TIMEOUT_SEC = 900.0
DEPS_VOLUME_PREFIX = "harbor-exec-deps-"
#: In the volume, written last: its presence says the environment is complete.
DEPS_MARKER = f"{DEPS_MOUNT}/installed.txt"
_WHEELHOUSE = "/harbor-exec-wheelhouse"

# Run by the runtime's Python in a helper container: pip (from its wheel) installs
# into a fresh directory that is renamed into place, so a second installer racing
# this one (another service on the same engine) never mixes its files in.
_INSTALL = f"""
import os, subprocess, sys, tempfile
pip, wheels = sys.argv[1], sys.argv[2:]
stage = tempfile.mkdtemp(dir={DEPS_MOUNT!r}, prefix=".install-")
os.chmod(stage, 0o755)
done = subprocess.run([sys.executable, "-I", pip, "install", "--quiet", "--no-index",
    "--no-deps", "--no-cache-dir", "--disable-pip-version-check", "--no-warn-script-location",
    "--target", stage, *wheels])
if done.returncode:
    sys.exit(done.returncode)
try:
    os.rename(stage, {DEPS_SITE!r})
except OSError:
    if not os.path.isdir({DEPS_SITE!r}):
        raise
with open({DEPS_MARKER!r}, "w") as marker:
    marker.write(" ".join(os.path.basename(w) for w in wheels) + "\\n")
"""


@dataclass(frozen=True)
class DepsLayer:
    """What a bundle needs besides its own code: its wheelhouse, installed with its pip."""

    wheelhouse: Path
    pip_wheel: str
    requirements_digest: str

    @property
    def volume_name(self) -> str:
        return DEPS_VOLUME_PREFIX + self.requirements_digest[:24]

    def wheels(self) -> list[Path]:
        return sorted(self.wheelhouse.glob("*.whl"))


def ensure_deps_env(runtime: ContainerRuntime, layer: DepsLayer, image: str) -> tuple[str, bool]:
    """The dependency environment's volume; returns ``(volume, installed_now)``.

    ``image`` (present on the engine) only hosts the install: the runtime's Python
    runs it, whatever the image holds. The runtime fills each volume once, so
    concurrent callers (prewarm, trials) install each requirement set once.
    """
    wheels = layer.wheels()
    command = [
        RUNTIME_PYTHON,
        "-I",
        "-c",
        _INSTALL,
        f"{_WHEELHOUSE}/{layer.pip_wheel}/pip",
        *(f"{_WHEELHOUSE}/{w.name}" for w in wheels),
    ]
    filled = runtime.fill_volume(
        VolumeFill(
            volume=layer.volume_name,
            mount=DEPS_MOUNT,
            marker=DEPS_MARKER,
            files=tuple((w, f"{_WHEELHOUSE}/{w.name}") for w in wheels),
            command=tuple(command),
            labels={LABEL_KIND: "deps"},
            timeout_sec=DEPS_BUILD_TIMEOUT_SEC,
        ),
        image,
    )
    return layer.volume_name, filled


__all__ = ["DEPS_VOLUME_PREFIX", "DepsLayer", "ensure_deps_env"]
