"""Wheels: building them with ``build``, reading them, and collecting dependencies.

The container's Python and platform usually differ from the host's (the read-only
runtime's 3.13 in task containers, any Python >= 3.11 here), so every decision
that depends on the interpreter, wheel tags and environment markers, is made
for the *target*, never for the running interpreter.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from email.parser import BytesHeaderParser
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import (
    InvalidWheelFilename,
    NormalizedName,
    canonicalize_name,
    parse_wheel_filename,
)
from packaging.version import Version

from harbor_exec.bundler.cache import entry_lock, publish, work_dir
from harbor_exec.bundler.errors import BundleBuildError, DependencyDownloadError

__all__ = [
    "DEFAULT_PLATFORM",
    "WheelInfo",
    "build_wheel",
    "download_wheels",
    "marker_environment",
    "platform_tags",
    "read_wheel",
    "sha256_file",
    "target_requirements",
]

# Debian bookworm ships glibc 2.36: every manylinux_2_N wheel with N <= 36 runs there.
#: The read-only runtime's glibc (Debian trixie: 2.41) on x86_64.
DEFAULT_PLATFORM = "manylinux_2_41_x86_64"

_BUILD_TIMEOUT_SEC = 900.0
_DOWNLOAD_TIMEOUT_SEC = 900.0
# pip evaluates transitive markers for the *host* interpreter; each round
# fetches what the target needs but pip skipped. Two rounds have always sufficed.
_MAX_DOWNLOAD_ROUNDS = 4

_GLIBC_TAG = re.compile(r"^manylinux_(?P<major>\d+)_(?P<minor>\d+)_(?P<arch>\w+)$")
_MUSL_TAG = re.compile(r"^musllinux_(?P<major>\d+)_(?P<minor>\d+)_(?P<arch>\w+)$")
_LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def platform_tags(platform: str) -> list[str]:
    """Every platform tag a machine of ``platform`` accepts, most specific first.

    ``manylinux_2_36_x86_64`` expands to ``manylinux_2_36`` .. ``manylinux_2_5`` plus
    the legacy aliases (``manylinux2014``, ``manylinux2010``, ``manylinux1``), so pip
    picks wheels built against any older glibc, not just the one named.
    A legacy name (``manylinux2014_x86_64``) is read as its glibc version.
    """
    legacy, _, legacy_arch = platform.partition("_")
    if legacy in _LEGACY_MANYLINUX and legacy_arch:
        major, minor = _LEGACY_MANYLINUX[legacy]
        platform = f"manylinux_{major}_{minor}_{legacy_arch}"
    glibc = _GLIBC_TAG.match(platform)
    if glibc is not None:
        major, minor, arch = int(glibc["major"]), int(glibc["minor"]), glibc["arch"]
        tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
        for name, version in _LEGACY_MANYLINUX.items():
            legacy_arches = {"x86_64", "i686"} if name != "manylinux2014" else {arch}
            if version <= (major, minor) and arch in legacy_arches:
                tags.append(f"{name}_{arch}")
        return tags
    musl = _MUSL_TAG.match(platform)
    if musl is not None:
        major, minor, arch = int(musl["major"]), int(musl["minor"]), musl["arch"]
        return [f"musllinux_{major}_{m}_{arch}" for m in range(minor, -1, -1)]
    return [platform]


def _arch(platform: str) -> str:
    for prefix in ("manylinux_", "musllinux_"):
        if platform.startswith(prefix):
            return platform.split("_", 3)[3]
    return platform.partition("_")[2] or platform


def marker_environment(python_version: str, platform: str) -> dict[str, str]:
    """PEP 508 marker values of a CPython ``python_version`` on Linux ``platform``."""
    full = python_version if python_version.count(".") >= 2 else f"{python_version}.0"
    return {
        "implementation_name": "cpython",
        "implementation_version": full,
        "os_name": "posix",
        "platform_machine": _arch(platform),
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": full,
        "python_version": ".".join(python_version.split(".")[:2]),
        "sys_platform": "linux",
    }


def _applies(req: Requirement, env: Mapping[str, str], extras: Iterable[str] = ("",)) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in extras)


def target_requirements(requires: Sequence[Requirement], env: Mapping[str, str]) -> list[str]:
    """The requirements that apply on the target, markers dropped, sorted."""
    kept = set()
    for req in requires:
        if _applies(req, env):
            bare = Requirement(str(req))
            bare.marker = None
            kept.add(str(bare))
    return sorted(kept, key=str.lower)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class WheelInfo:
    """What the bundler needs to know about one wheel file."""

    path: Path
    name: NormalizedName
    version: Version
    requires: tuple[Requirement, ...]
    top_level: frozenset[str] = field(default_factory=frozenset)


def read_wheel(path: Path) -> WheelInfo:
    """Name, version, ``Requires-Dist`` and top-level names of a wheel file."""
    try:
        name, version, _build, _tags = parse_wheel_filename(path.name)
    except InvalidWheelFilename as exc:
        raise BundleBuildError(f"{path} is not a wheel file name: {exc}") from exc
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            metadata_name = next(
                (n for n in names if n.count("/") == 1 and n.endswith(".dist-info/METADATA")),
                None,
            )
            if metadata_name is None:
                raise BundleBuildError(f"wheel {path} has no .dist-info/METADATA; rebuild it.")
            headers = BytesHeaderParser().parsebytes(archive.read(metadata_name))
    except zipfile.BadZipFile as exc:
        raise BundleBuildError(f"wheel {path} is not a valid zip file: {exc}") from exc
    requires = []
    for line in headers.get_all("Requires-Dist") or []:
        try:
            requires.append(Requirement(line))
        except InvalidRequirement as exc:
            raise BundleBuildError(
                f"wheel {path.name} declares an invalid dependency {line!r}: {exc}; "
                "fix it in the project's dependencies."
            ) from exc
    top_level = frozenset(n.split("/", 1)[0] for n in names if "/" in n)
    return WheelInfo(path, name, version, tuple(requires), top_level)


def _run(
    cmd: Sequence[str],
    *,
    cwd: Path | None,
    timeout: float,
    extra_env: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """Run a tool, capturing stdout and stderr together (for error tails)."""
    env = {
        **os.environ,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        **(extra_env or {}),
    }
    try:
        done = subprocess.run(
            list(cmd),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        output = exc.output if isinstance(exc.output, str) else ""
        return -1, output + f"\n[timed out after {timeout:.0f}s]"
    return done.returncode, done.stdout


def build_wheel(
    srcdir: Path,
    outdir: Path,
    *,
    what: str,
    isolated: bool = True,
    env_cache: Path | None = None,
) -> Path:
    """Build one wheel of ``srcdir`` into ``outdir`` with the ``build`` frontend.

    ``isolated`` builds with only the project's ``[build-system] requires``
    installed, i.e. with the project's own build backend: in a fresh environment
    per build, or, with ``env_cache``, in one environment per requirement set kept
    there and reused (creating it is most of a small project's build time).
    """
    if importlib.util.find_spec("build") is None:
        raise BundleBuildError(
            f"the 'build' package is not installed for {sys.executable}; "
            "install it with: pip install 'harbor-exec[bundler]'"
        )
    outdir.mkdir(parents=True, exist_ok=True)
    if isolated and env_cache is None:
        cmd = [sys.executable, "-m", "build", "--wheel", "--outdir", str(outdir), str(srcdir)]
        code, output = _run(cmd, cwd=srcdir, timeout=_BUILD_TIMEOUT_SEC)
        if code != 0:
            raise BundleBuildError(
                f"building the wheel of {what} failed (exit code {code}).", output=output
            )
    else:
        _build_in_env(srcdir, outdir, what=what, env_cache=env_cache if isolated else None)
    wheels = sorted(outdir.glob("*.whl"))
    if len(wheels) != 1:
        raise BundleBuildError(f"building the wheel of {what} gave {len(wheels)} wheels, not 1.")
    return wheels[0]


def _build_in_env(srcdir: Path, outdir: Path, *, what: str, env_cache: Path | None) -> None:
    """Build with ``build.ProjectBuilder`` on this interpreter (``env_cache`` None) or
    on the cached environment of the project's build requirements."""
    import build  # the bundler extra; checked by the caller

    output: list[str] = []

    def runner(
        cmd: Sequence[str], cwd: str | None = None, extra_environ: Mapping[str, str] | None = None
    ) -> None:
        code, text = _run(cmd, cwd=Path(cwd) if cwd else None, timeout=_BUILD_TIMEOUT_SEC,
                          extra_env=extra_environ)  # fmt: skip
        output.append(text)
        if code != 0:
            raise subprocess.CalledProcessError(code, list(cmd), text)

    def failed(reason: str) -> BundleBuildError:
        return BundleBuildError(f"building the wheel of {what} failed ({reason}).",
                                output="".join(output))  # fmt: skip

    try:
        python = sys.executable
        if env_cache is not None:
            requires = build.ProjectBuilder(srcdir).build_system_requires
            python = _build_env(env_cache, sorted(requires), output)
        builder = build.ProjectBuilder(srcdir, python_executable=python, runner=runner)
        if env_cache is None:
            # This interpreter's own packages: what build's --no-isolation checks.
            missing = builder.check_dependencies("wheel")
            if missing:
                listed = ", ".join(sorted(chain[-1] for chain in missing))
                raise failed(f"build requirements missing from {python}: {listed}")
        else:
            # What the backend asks for beyond [build-system] (usually nothing),
            # installed into the cached environment once.
            _add_to_env(Path(python), sorted(builder.get_requires_for_build("wheel")), output)
        builder.build("wheel", outdir)
    except build.BuildBackendException as exc:
        raise failed(f"the build backend failed: {exc.exception!r}") from exc
    except build.BuildException as exc:
        raise failed(str(exc)) from exc


def _pip_install(python: str, requirements: Sequence[str], output: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "--python", python, "install", "--progress-bar", "off"]
    code, text = _run([*cmd, *requirements], cwd=None, timeout=_BUILD_TIMEOUT_SEC)
    output.append(text)
    if code != 0:
        raise BundleBuildError(
            f"pip could not install the build requirements [{', '.join(requirements)}].",
            output="".join(output),
        )


def _add_to_env(python: Path, requires: Sequence[str], output: list[str]) -> None:
    if not requires:
        return
    marker = (
        python.parent.parent / f".added-{hashlib.sha256(repr(requires).encode()).hexdigest()[:16]}"
    )
    if not marker.is_file():
        _pip_install(str(python), requires, output)
        marker.touch()


def _build_env(env_cache: Path, requires: Sequence[str], output: list[str]) -> str:
    """The interpreter of the cached environment holding ``requires``, made on first use.

    Keyed by the requirement strings and this interpreter: a project that pins its
    backend gets exactly that version; an unpinned one keeps the version first
    installed until the cache entry is removed.
    """
    key = hashlib.sha256(repr((list(requires), sys.version, sys.executable)).encode())
    entry = env_cache / "build-envs" / key.hexdigest()[:32]
    python = entry / "bin" / "python"
    if not (entry / _ENV_READY).is_file():
        with entry_lock(env_cache, "build-env", key.hexdigest()):
            if not (entry / _ENV_READY).is_file():  # not made while this process waited
                _make_build_env(env_cache, entry, requires, output)
    return str(python)


def _make_build_env(
    env_cache: Path, entry: Path, requires: Sequence[str], output: list[str]
) -> None:
    work = work_dir(env_cache, "build-env-")
    try:
        env = work / "env"
        code, text = _run([sys.executable, "-m", "venv", "--without-pip", str(env)], cwd=None,
                          timeout=_BUILD_TIMEOUT_SEC)  # fmt: skip
        output.append(text)
        if code != 0:
            raise BundleBuildError("could not create a build environment.", output=text)
        if requires:
            _pip_install(str(env / "bin" / "python"), requires, output)
        (env / _ENV_READY).touch()
        # A venv finds its prefix from the pyvenv.cfg beside its interpreter, so
        # it works from where it is renamed to (no scripts of it are used).
        if not publish(env, entry) and not (entry / _ENV_READY).is_file():
            raise BundleBuildError(f"the build environment {entry} is incomplete; remove it.")
    finally:
        shutil.rmtree(work, ignore_errors=True)


_ENV_READY = ".harbor-exec-ready"


@dataclass(frozen=True, slots=True)
class Target:
    """The container's interpreter, as pip and marker evaluation see it."""

    python_version: str
    platform: str

    @property
    def tags(self) -> list[str]:
        return platform_tags(self.platform)

    @property
    def env(self) -> dict[str, str]:
        return marker_environment(self.python_version, self.platform)


def _pip_download(requirements: Sequence[str], dest: Path, target: Target) -> None:
    if importlib.util.find_spec("pip") is None:
        raise DependencyDownloadError(
            f"pip is not installed for {sys.executable}; the bundler runs 'pip download' "
            "to collect dependency wheels. Install pip into that environment."
        )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--python-version",
        target.python_version,
        "--implementation",
        "cp",
        *(arg for tag in target.tags for arg in ("--platform", tag)),
        "--dest",
        str(dest),
        "--progress-bar",
        "off",
        *requirements,
    ]
    code, output = _run(cmd, cwd=dest, timeout=_DOWNLOAD_TIMEOUT_SEC)
    if code != 0:
        listed = ", ".join(requirements)
        raise DependencyDownloadError(
            f"pip could not collect wheels of [{listed}] for CPython {target.python_version} "
            f"on {target.platform}. A dependency may ship no wheel for that Python and platform "
            "(pin a version that does), or may not exist, or the package index is unreachable "
            "(pip honours PIP_INDEX_URL / PIP_FIND_LINKS).",
            output=output,
        )


def _index(dest: Path) -> dict[NormalizedName, list[WheelInfo]]:
    found: dict[NormalizedName, list[WheelInfo]] = {}
    for path in sorted(dest.glob("*.whl")):
        info = read_wheel(path)
        found.setdefault(info.name, []).append(info)
    for infos in found.values():
        infos.sort(key=lambda i: i.version, reverse=True)
    return found


def _closure(
    roots: Sequence[Requirement], wheels: Mapping[NormalizedName, list[WheelInfo]], target: Target
) -> tuple[dict[NormalizedName, WheelInfo], list[Requirement]]:
    """Wheels the target needs from ``roots``, evaluating markers for the target.

    Returns the chosen wheel per project and the requirements nothing satisfies.
    """
    env = target.env
    chosen: dict[NormalizedName, WheelInfo] = {}
    missing: list[Requirement] = []
    seen: set[tuple[NormalizedName, str]] = set()
    stack = [(req, ("",)) for req in roots]
    while stack:
        req, extras = stack.pop()
        if not _applies(req, env, extras):
            continue
        name = canonicalize_name(req.name)
        wanted_extras = ("", *sorted(req.extras))
        candidates = [chosen[name]] if name in chosen else wheels.get(name, [])
        match = next(
            (w for w in candidates if req.specifier.contains(w.version, prereleases=True)), None
        )
        if match is None:
            missing.append(req)
            continue
        chosen[name] = match
        for extra in wanted_extras:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            stack.extend((dep, (extra,)) for dep in match.requires)
    return chosen, missing


def download_wheels(
    requirements: Sequence[Requirement], local: Sequence[Path], dest: Path, target: Target
) -> list[Path]:
    """Collect into ``dest`` the wheels of ``requirements`` plus ``local`` wheel files,
    and all their dependencies, for ``target``.

    Local wheels (harbor-exec's runtime) are copied in, never looked up on an index,
    so a same-named project on PyPI can not replace them. Wheels the target does
    not need (pip pulled them for the host's markers) are removed: ``dest`` ends up
    exactly the set to install.
    """
    dest.mkdir(parents=True, exist_ok=True)
    roots = list(requirements)
    to_fetch = {str(r) for r in requirements}
    for path in local:
        copy_or_link(path, dest / path.name)
        info = read_wheel(path)
        roots.append(Requirement(f"{info.name}=={info.version}"))
        to_fetch.update(str(_without_marker(r)) for r in info.requires if _applies(r, target.env))
    for _ in range(_MAX_DOWNLOAD_ROUNDS):
        if to_fetch:
            _pip_download(sorted(to_fetch), dest, target)
        chosen, missing = _closure(roots, _index(dest), target)
        if not missing:
            break
        to_fetch = {str(_without_marker(r)) for r in missing}
    else:
        listed = ", ".join(sorted({str(r) for r in missing}))
        raise DependencyDownloadError(
            f"dependencies still unresolved for CPython {target.python_version} on "
            f"{target.platform} after {_MAX_DOWNLOAD_ROUNDS} rounds of pip download: {listed}. "
            "Their version constraints probably conflict; pin compatible versions."
        )
    keep = {w.path for w in chosen.values()}
    for path in dest.glob("*.whl"):
        if path not in keep:
            path.unlink()
    return sorted(keep)


def _without_marker(req: Requirement) -> Requirement:
    bare = Requirement(str(req))
    bare.marker = None
    return bare


def copy_or_link(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (same cache filesystem), copying when it cannot."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
