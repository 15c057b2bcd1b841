"""Base images for machines without a registry, and pruning the images we made.

``bootstrap`` makes sure every base image the examples build on exists: found
locally, else pulled, else built here (``debian:bookworm-slim`` from Debian's
own packages with ``debootstrap`` + import; the others from ``images/<name>/Dockerfile``
on top of it). Idempotent: with the images present it only inspects them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harbor_exec.docker_runtime import DockerRuntime
from harbor_exec.errors import EnvironmentStartError, HarborExecError
from harbor_exec.runtime import LABEL_KIND, LABEL_MANAGED

DEBIAN_IMAGE = "debian:bookworm-slim"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


class BootstrapError(HarborExecError):
    """A base image could not be made; the message says which step failed and why."""


@dataclass(frozen=True)
class BaseImage:
    tag: str
    dockerfile_dir: str | None  # None: the debootstrap root filesystem


BASE_IMAGES = (
    BaseImage(DEBIAN_IMAGE, None),
    BaseImage("python:3.11-slim-bookworm", "python-3.11-slim-bookworm"),
)


def images_dir() -> Path:
    """The image definitions: packaged with the wheel, or the repository's ``images/``."""
    packaged = Path(__file__).parent / "_images"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "images"


def _debootstrap_rootfs(runtime: DockerRuntime, tag: str, log: Callable[[str], None]) -> None:
    if os.geteuid() != 0:
        raise BootstrapError(f"building {tag} with debootstrap needs root; run as root")
    if shutil.which("debootstrap") is None:
        raise BootstrapError(
            f"cannot build {tag}: debootstrap is not installed (apt-get install debootstrap, "
            "or run scripts/setup.sh)"
        )
    mirror = os.environ.get("HARBOR_EXEC_DEBIAN_MIRROR", DEFAULT_MIRROR)
    with tempfile.TemporaryDirectory(prefix="hx-rootfs-") as scratch:
        root = Path(scratch) / "rootfs"
        log(f"debootstrap --variant=minbase bookworm from {mirror} (about 30 s)")
        done = subprocess.run(
            ["debootstrap", "--variant=minbase", "bookworm", str(root), mirror],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise BootstrapError(f"debootstrap failed (exit {done.returncode}):\n{tail}")
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


def bootstrap(runtime: DockerRuntime, *, log: Callable[[str], None] = print) -> dict[str, str]:
    """Make every base image present; returns ``{tag: "present" | "pulled" | "built"}``."""
    outcome: dict[str, str] = {}
    for image in BASE_IMAGES:
        if runtime.image_exists(image.tag):
            outcome[image.tag] = "present"
            continue
        try:
            runtime.ensure_present(image.tag)
            outcome[image.tag] = "pulled"
            continue
        except EnvironmentStartError:
            log(f"{image.tag}: not present and no registry answers; building it locally")
        if image.dockerfile_dir is None:
            _debootstrap_rootfs(runtime, image.tag, log)
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
    return outcome


def prune(runtime: DockerRuntime, *, include_base: bool = False) -> list[str]:
    """Remove the images we made (task environments, dependency layers; base images too
    with ``include_base``). Returns the removed tags."""
    removed: list[str] = []
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
