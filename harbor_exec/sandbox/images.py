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
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from harbor_exec.errors import EnvironmentStartError, HarborExecError
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_KIND, LABEL_MANAGED
from harbor_exec.sandbox.runtime_build import build_runtime, load_runtime_build
from harbor_exec.sandbox.runtime_volume import RuntimeContent
from harbor_exec.sandbox.slim_rootfs import make_slim

DEBIAN_IMAGE = "debian:bookworm-slim"
#: The environment variable behind ``images bootstrap --mirror``.
MIRROR_ENV = "HARBOR_EXEC_DEBIAN_MIRROR"
APT_DIR = Path("/etc/apt")
# Debian's release codenames: an apt source for one of them (component main) is a
# Debian archive mirror. Aliases such as "stable" are left out on purpose: third-party
# repositories use them too ("deb https://vendor.example/apt stable main").
_DEBIAN_CODENAMES = frozenset({"buster", "bullseye", "bookworm", "trixie", "forky", "duke", "sid"})
_MIRROR_SCHEMES = ("http://", "https://", "file:/")
# A one-line entry: deb [option=value ...] uri suite [component ...]
_ONE_LINE = re.compile(r"deb\s+(?:\[[^\]]*\]\s*)?(\S+)\s+(\S+)\s*(.*)")


class BootstrapError(HarborExecError):
    """A base image could not be made; the message says which step failed and why."""


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


@dataclass(frozen=True)
class AptSource:
    """One ``deb`` entry of the host's apt configuration."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    file: Path


def _one_line_sources(path: Path, text: str) -> Iterator[AptSource]:
    for raw in text.splitlines():
        match = _ONE_LINE.match(raw.split("#", 1)[0].strip())
        if match:
            uri, suite, components = match.groups()
            yield AptSource(uri, (suite,), tuple(components.split()), path)


def _deb822_sources(path: Path, text: str) -> Iterator[AptSource]:
    # Stanzas of "Field: value" lines, separated by blank lines; values may continue
    # on indented lines. See sources.list(5).
    stanzas: list[dict[str, str]] = [{}]
    key = ""
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            stanzas.append({})
            key = ""
        elif raw[0] in " \t" and key:
            stanzas[-1][key] += " " + raw.strip()
        elif ":" in raw:
            key, _, value = raw.partition(":")
            key = key.strip().lower()
            stanzas[-1][key] = value.strip()
    for stanza in stanzas:
        if "deb" not in stanza.get("types", "").split():
            continue
        if stanza.get("enabled", "yes").strip().lower() == "no":
            continue
        suites = tuple(stanza.get("suites", "").split())
        components = tuple(stanza.get("components", "").split())
        for uri in stanza.get("uris", "").split():
            yield AptSource(uri, suites, components, path)


def apt_sources(apt_dir: Path = APT_DIR) -> list[AptSource]:
    """The host's ``deb`` sources in apt's order: ``sources.list``, then the files of
    ``sources.list.d`` (``*.list`` one-line and ``*.sources`` deb822) by name."""
    files = [apt_dir / "sources.list"]
    parts = apt_dir / "sources.list.d"
    if parts.is_dir():
        files += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources"))
    found: list[AptSource] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parse = _deb822_sources if path.suffix == ".sources" else _one_line_sources
        found.extend(parse(path, text))
    return found


def host_debian_mirror(apt_dir: Path = APT_DIR) -> AptSource | None:
    """The first apt source that is a Debian archive mirror: a ``deb`` entry for a
    Debian release (``bookworm``, not ``bookworm-security``) with component ``main``."""
    for source in apt_sources(apt_dir):
        if (
            source.uri.startswith(_MIRROR_SCHEMES)
            and "main" in source.components
            and any(suite in _DEBIAN_CODENAMES for suite in source.suites)
        ):
            return source
    return None


def debian_mirror(mirror: str | None = None, *, apt_dir: Path = APT_DIR) -> tuple[str, str]:
    """The mirror debootstrap uses and where it came from: ``mirror`` when given, else
    the host's apt sources. Raises :class:`BootstrapError` when there is neither."""
    if mirror:
        return mirror, "--mirror"
    found = host_debian_mirror(apt_dir)
    if found is None:
        raise BootstrapError(
            f"cannot build {DEBIAN_IMAGE}: no Debian mirror in this host's apt sources "
            f"({apt_dir}/sources.list, {apt_dir}/sources.list.d/*.list or *.sources: a "
            f"'deb' entry for a Debian release with component main). Name one with "
            f"`harbor-exec images bootstrap --mirror URL` (or ${MIRROR_ENV})."
        )
    return found.uri, str(found.file)


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
