"""The bundle's dependency environment: its wheelhouse, installed once per requirement set.

A bundle's third-party wheels (and harbor-exec's container side, and pydantic) are
installed with the runtime's own Python (``harbor_exec.sandbox.runtime_volume``) into
a named volume of their own, keyed by the requirement set's digest alone, and mounted
read-only at ``DEPS_MOUNT`` into every trial that runs the bundle: nothing is built
FROM the task image, so a dataset of a thousand tasks that share a requirement set
installs it once. The runtime's site-packages name ``DEPS_SITE`` in a ``.pth`` file,
so the runner finds it under ``python -I`` too.

A plain value (``DepsLayer``) says what to install; ``ensure_deps_env`` fills the
volume on whichever engine runs the trial (this machine's, or a Ray node's). Asked for
(``SandboxPolicy.deps_in_image``, osmosis-ai's ``patch_dockerfile_with_sdk=True``),
``bake_deps_into_image`` adds the same install as a layer on top of a task image.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from harbor_exec.container.exchange import DEPS_MOUNT, DEPS_SITE, RUNTIME_PYTHON
from harbor_exec.errors import EnvironmentStartError
from harbor_exec.sandbox.runtime import LABEL_KIND, ContainerRuntime, ContainerSpec, VolumeFill

DEPS_BUILD_TIMEOUT_SEC = 900.0
DEPS_VOLUME_PREFIX = "harbor-exec-deps-"
#: In the volume, written last: its presence says the environment is complete.
DEPS_MARKER = f"{DEPS_MOUNT}/installed.txt"
_WHEELHOUSE = "/harbor-exec-wheelhouse"

# Run by the runtime's Python in a helper container: pip (from its wheel) installs
# into a fresh directory that is renamed into place, so a second installer racing
# this one (another service on the same engine) never mixes its files in. Then the
# launchers (``{path: text}``, JSON) are written, each by rename, and the marker last.
_INSTALL = """
import json, os, subprocess, sys, tempfile
mount, site, marker, launchers, pip = sys.argv[1:6]
wheels = sys.argv[6:]
stage = tempfile.mkdtemp(dir=mount, prefix=".install-")
os.chmod(stage, 0o755)
done = subprocess.run([sys.executable, "-I", pip, "install", "--quiet", "--no-index",
    "--no-deps", "--no-cache-dir", "--disable-pip-version-check", "--no-warn-script-location",
    "--target", stage, *wheels])
if done.returncode:
    sys.exit(done.returncode)
try:
    os.rename(stage, site)
except OSError:
    if not os.path.isdir(site):
        raise
for path, text in json.loads(launchers).items():
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
    os.chmod(path + ".tmp", 0o755)
    os.rename(path + ".tmp", path)
with open(marker, "w") as handle:
    handle.write(" ".join(os.path.basename(w) for w in wheels) + "\\n")
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


@dataclass(frozen=True)
class WheelInstall:
    """Wheels installed once into a named volume, by the runtime's Python and pip.

    ``site`` and ``marker`` are container paths under ``mount``; ``launchers`` are
    executable text files (container path: content) written after the install;
    ``files`` (host file, container path under ``mount``) are placed as they are,
    modes kept, before it; ``pip_wheel`` is the file name of pip's wheel among ``wheels``.
    """

    volume: str
    mount: str
    site: str
    marker: str
    wheels: tuple[Path, ...]
    pip_wheel: str
    kind: str  # the volume's LABEL_KIND
    launchers: Mapping[str, str] = field(default_factory=dict)
    files: tuple[tuple[Path, str], ...] = ()


def install_wheels(runtime: ContainerRuntime, install: WheelInstall, image: str) -> bool:
    """Fill ``install.volume`` unless complete; True when this call installed it.

    ``image`` (present on the engine) only hosts the install: the runtime's Python
    runs it, whatever the image holds. The runtime fills each volume once, so
    concurrent callers (prewarm, trials) install each volume once.
    """
    command = [
        RUNTIME_PYTHON,
        "-I",
        "-c",
        _INSTALL,
        install.mount,
        install.site,
        install.marker,
        json.dumps(dict(install.launchers)),
        # pip runs from its wheel (a zip on sys.path), not an install of it.
        f"{_WHEELHOUSE}/{install.pip_wheel}/pip",
        *(f"{_WHEELHOUSE}/{w.name}" for w in install.wheels),
    ]
    return runtime.fill_volume(
        VolumeFill(
            volume=install.volume,
            mount=install.mount,
            marker=install.marker,
            files=(
                *((w, f"{_WHEELHOUSE}/{w.name}") for w in install.wheels),
                *install.files,
            ),
            command=tuple(command),
            labels={LABEL_KIND: install.kind},
            timeout_sec=DEPS_BUILD_TIMEOUT_SEC,
        ),
        image,
    )


def ensure_deps_env(runtime: ContainerRuntime, layer: DepsLayer, image: str) -> tuple[str, bool]:
    """The dependency environment's volume; returns ``(volume, installed_now)``."""
    install = WheelInstall(
        volume=layer.volume_name,
        mount=DEPS_MOUNT,
        site=DEPS_SITE,
        marker=DEPS_MARKER,
        wheels=tuple(layer.wheels()),
        pip_wheel=layer.pip_wheel,
        kind="deps",
    )
    return layer.volume_name, install_wheels(runtime, install, image)


#: Tag of a task image with a dependency environment baked in (``bake_deps_into_image``).
BAKED_IMAGE_REPO = "harbor-exec/deps-baked"


def bake_deps_into_image(
    runtime: ContainerRuntime, image: str, volume: str, *, scratch: Path
) -> tuple[str, bool]:
    """``image`` with the filled ``volume``'s tree as a layer at ``DEPS_MOUNT`` (the
    osmosis-ai ``patch_dockerfile_with_sdk=True`` way); returns ``(tag, built_now)``.

    The tree is read from the volume (installed once by the runtime's Python, as for
    the mount) through a helper container that never starts, and added by one
    ``ADD`` on top of ``image``: nothing of the task image runs, and the tag is keyed
    by ``image`` and ``volume``, so each pair is built once. Trial containers of such
    an image get the deps from their own writable layer (the agent may change its
    copy, not the image); the mounted volume stays the read-only default.
    """
    key = hashlib.sha256(f"{image}\0{volume}".encode()).hexdigest()[:32]
    tag = f"{BAKED_IMAGE_REPO}:{key}"
    if runtime.image_exists(tag):
        return tag, False
    helper = runtime.create(
        ContainerSpec(
            image=image,
            name=f"harbor-exec-bake-{key[:12]}-{secrets.token_hex(3)}",
            labels={LABEL_KIND: "deps-bake"},
            network="none",
            deps_volume=volume,
        )
    )
    try:
        context = scratch / f"bake-{key[:12]}-{secrets.token_hex(3)}"
        context.mkdir(parents=True)
        stream = runtime.get_archive(helper, DEPS_MOUNT)
        if stream is None:
            raise EnvironmentStartError(f"the dependency volume {volume} has no {DEPS_MOUNT}")
        with (context / "deps.tar").open("wb") as out:
            for chunk in stream:
                out.write(chunk)
    finally:
        runtime.remove(helper)
    parent = str(PurePosixPath(DEPS_MOUNT).parent)
    (context / "Dockerfile").write_text(f"FROM {image}\nADD deps.tar {parent}/\n")
    try:
        built = runtime.ensure_image(
            context_dir=context,
            tag=tag,
            timeout_sec=DEPS_BUILD_TIMEOUT_SEC,
            labels={LABEL_KIND: "deps-baked"},
        )
    finally:
        shutil.rmtree(context, ignore_errors=True)
    return tag, built.built


__all__ = [
    "BAKED_IMAGE_REPO",
    "DEPS_VOLUME_PREFIX",
    "DepsLayer",
    "WheelInstall",
    "bake_deps_into_image",
    "ensure_deps_env",
    "install_wheels",
]
