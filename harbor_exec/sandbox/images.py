"""Base images for machines without a registry, and pruning the images we made.

``bootstrap`` makes sure every base image the examples build on exists, and the
read-only container runtime (``harbor_exec.sandbox.runtime_build``): found
locally, else pulled, else built here (``debian:bookworm-slim`` and
``debian:trixie-slim`` from Debian's own packages with ``debootstrap``, the official
slim image's settings (``harbor_exec.sandbox.slim_rootfs``) and import; the
others from ``images/<name>/Dockerfile`` on top of them). Idempotent: with the images
present it only inspects them.

debootstrap fetches from the Debian mirror the host's apt already uses (read from
``/etc/apt/sources.list``, ``sources.list.d/*.list`` and deb822 ``*.sources``), or
from the one the caller names (``images bootstrap --mirror URL``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harbor_exec.errors import EnvironmentStartError
from harbor_exec.sandbox.apt_mirror import (
    BootstrapError,
    debian_mirror,
)
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_KIND, LABEL_MANAGED
from harbor_exec.sandbox.runtime_build import build_runtime, load_runtime_build
from harbor_exec.sandbox.runtime_volume import RuntimeContent
from harbor_exec.sandbox.slim_rootfs import make_slim

DEBIAN_IMAGE = "debian:bookworm-slim"


@dataclass(frozen=True)
class BaseImage:
    tag: str
    dockerfile_dir: str | None  # None: the debootstrap root filesystem of ``suite``
    suite: str | None = None


#: What the examples build on, and (trixie, Python 3.13) the service image (``Dockerfile``).
BASE_IMAGES = (
    BaseImage(DEBIAN_IMAGE, None, "bookworm"),
    BaseImage("python:3.11-slim-bookworm", "python-3.11-slim-bookworm"),
    BaseImage("debian:trixie-slim", None, "trixie"),
    BaseImage("python:3.13-slim-trixie", "python-3.13-slim-trixie"),
)


def images_dir() -> Path:
    """The image definitions: packaged with the wheel, or the repository's ``images/``."""
    package = Path(__file__).resolve().parent.parent  # harbor_exec/
    packaged = package / "_images"
    if packaged.is_dir():
        return packaged
    return package.parent / "images"


def _debootstrap_rootfs(
    runtime: DockerRuntime, image: BaseImage, mirror: str | None, log: Callable[[str], None]
) -> None:
    tag, suite = image.tag, image.suite
    assert suite is not None
    if os.geteuid() != 0:
        raise BootstrapError(f"building {tag} with debootstrap needs root; run as root")
    if shutil.which("debootstrap") is None:
        raise BootstrapError(
            f"cannot build {tag}: debootstrap is not installed (apt-get install debootstrap, "
            "or run scripts/setup.sh)"
        )
    url, origin = debian_mirror(mirror)
    with tempfile.TemporaryDirectory(prefix="hx-rootfs-") as scratch:
        root = Path(scratch) / "rootfs"
        log(f"debootstrap --variant=minbase {suite} from {url} ({origin}; about 30 s)")
        done = subprocess.run(
            ["debootstrap", "--variant=minbase", suite, str(root), url],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise BootstrapError(f"debootstrap failed (exit {done.returncode}):\n{tail}")
        make_slim(root)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(root / cache, ignore_errors=True)
            (root / cache).mkdir(parents=True, exist_ok=True)
        tarball = Path(scratch) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(root), "-cf", str(tarball), "."], check=True)
        log(f"docker import as {tag}")
        runtime.import_rootfs(
            tarball,
            tag,
            changes=[
                'CMD ["bash"]',
                "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                f"LABEL {LABEL_MANAGED}=true {LABEL_KIND}=base",
            ],
        )


def bootstrap(
    runtime: DockerRuntime,
    *,
    mirror: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, str]:
    """Make every base image present; returns ``{tag: "present" | "pulled" | "built"}``.

    ``mirror`` is the Debian mirror for debootstrap (default: the host's apt sources);
    it is only looked for when an image has to be built from Debian's packages."""
    outcome: dict[str, str] = {}
    for image in BASE_IMAGES:
        if runtime.image_exists(image.tag):
            outcome[image.tag] = "present"
            continue
        try:
            runtime.ensure_present(image.tag, any_registry=True)  # the operator's bootstrap
            outcome[image.tag] = "pulled"
            continue
        except EnvironmentStartError:
            log(f"{image.tag}: not present and no registry answers; building it locally")
        if image.dockerfile_dir is None:
            _debootstrap_rootfs(runtime, image, mirror, log)
        else:
            context = images_dir() / image.dockerfile_dir
            result = runtime.ensure_image(
                context_dir=context,
                tag=image.tag,
                timeout_sec=900,
                labels={LABEL_KIND: "base"},
            )
            log(f"{image.tag}: built in {result.duration_sec:.1f}s")
        outcome[image.tag] = "built"
    outcome["container runtime"] = ensure_container_runtime(mirror=mirror, log=log)
    return outcome


def ensure_container_runtime(
    *, mirror: str | None = None, log: Callable[[str], None] = print
) -> str:
    """Build the read-only runtime (``runtime_build``) unless this machine has it:
    ``"present"`` or ``"built"``."""
    if load_runtime_build() is not None:
        return "present"
    build_runtime(debian_mirror(mirror)[0], log=log)
    return "built"


def prune(runtime: DockerRuntime, *, include_base: bool = False) -> list[str]:
    """Remove the images we made (task environments; base images too with
    ``include_base``), every dependency environment's volume and the runtime volumes of
    older runtimes (none a container uses). Returns the removed tags and volume names."""
    current = load_runtime_build()
    keep = {RuntimeContent.load().volume_name} if current is not None else set()
    removed: list[str] = runtime.prune_volumes(keep)
    for info in runtime.list_images():
        if info.kind == "base" and not include_base:
            continue
        runtime.remove_image(info.tag)
        removed.append(info.tag)
    return removed


def build_cache_report(runtime: DockerRuntime, *, prune: bool) -> str:
    """Prune the engine's unused build cache when asked; say what is left either way.

    The engine does not say which build made which cache record, so pruning it is
    an explicit, engine-wide choice (``images prune --build-cache``).
    """
    lines = []
    if prune:
        lines.append(f"build cache: {runtime.prune_build_cache() / 1e6:.1f} MB reclaimed")
    records, size = runtime.build_cache_usage()
    hint = "" if prune or not records else " (--build-cache removes what is unused)"
    lines.append(f"build cache left: {records} record(s), {size / 1e6:.1f} MB{hint}")
    return "\n".join(lines)
