"""Build the read-only runtime's tree: a relocatable CPython, tini and busybox from Debian.

Every task container gets harbor-exec's own programs from a volume mounted read-only
at ``RUNTIME_MOUNT`` (``harbor_exec.sandbox.runtime_volume``), never from the task's
image: most task images have no Python (or an old one, or musl instead of glibc), and
anything in the image is the agent's to replace. So the runtime carries its own:

* ``python/``: Debian's CPython (``RUNTIME_SUITE``'s ``python3.X-minimal`` and
  ``libpython3.X-stdlib``), every module compiled ahead of time (the volume is
  read-only, so nothing could be compiled later);
* ``lib/``: glibc's dynamic loader and every shared library the interpreter and its
  extension modules need. The interpreter's ELF header names this loader by absolute
  path and its ``DT_RPATH`` names this directory (``patchelf``), which glibc's loader
  searches first for every library it loads, so the image's libc (another glibc,
  musl, or none) never takes part and no ``LD_*`` variable leaks into what the
  workflow starts;
* ``bin/tini`` and ``bin/busybox``: the container's init and its keep-alive, both
  statically linked. They are execute-only (mode 0111) and run as a uid of their
  own (``bin/setpriv``, util-linux's, drops to it): a process that cannot read its
  own program is not dumpable, so not even a root agent (without
  ``CAP_SYS_PTRACE``) can open its ``/proc/<pid>/mem``;
* ``bin/tmux``: Debian's tmux, patched like the interpreter (its libraries are in
  ``lib/``), for Harbor's terminus-2, which drives the container through tmux: an
  image without tmux works, and nothing is installed at trial time;
* ``runtime.json`` (last in the archive): what was built and its digest, so a volume
  holding it is complete.

The packages come from Debian with ``debootstrap`` (the tool that resolves their
dependencies), once per machine, into the cache: on the first trial that needs it (one
build, whoever asks at once) or ahead of time with ``harbor-exec images bootstrap``
(``scripts/setup.sh`` runs it). Host side, needs root, debootstrap and patchelf.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from harbor_exec.cache import cache_root
from harbor_exec.container.exchange import (
    DEPS_SITE,
    RUNTIME_LIB,
    RUNTIME_LOADER,
    RUNTIME_MOUNT,
    RUNTIME_PYTHON_VERSION,
)
from harbor_exec.errors import HarborExecError

RUNTIME_SUITE = "trixie"
#: Bump when the tree's layout or recipe changes: a new directory, a new volume.
RUNTIME_RECIPE = 4
_PY = f"python{RUNTIME_PYTHON_VERSION}"
RUNTIME_PACKAGES = (f"{_PY}-minimal", f"lib{_PY}-stdlib", "tini", "busybox-static", "tmux")
RUNTIME_ARCHIVE = "runtime.tar"
RUNTIME_INFO = "runtime.json"
#: Not shipped: tests, GUI and the stdlib's own installers.
_STDLIB_SKIP = frozenset(
    {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "EXTERNALLY-MANAGED"}
)
_LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib")
#: glibc's own objects keep their headers; everything else is found through the
#: interpreter's DT_RPATH.
_LOADER_NAME = Path(RUNTIME_LOADER).name
#: The system libraries manylinux wheels may link against (PEP 600's policy), so a
#: bundle's compiled dependencies load on any image; libgcc_s is also dlopened by glibc
#: itself (thread exit and cancellation unwind with it).
_MANYLINUX_LIBS = (
    "libgcc_s.so.1",
    "libstdc++.so.6",
    "libm.so.6",
    "libdl.so.2",
    "librt.so.1",
    "libpthread.so.0",
    "libutil.so.1",
    "libresolv.so.2",
    "libcrypt.so.1",
    "libz.so.1",
)


class RuntimeBuildError(HarborExecError):
    """The runtime could not be built; the message names the step and the fix."""


@dataclass(frozen=True)
class RuntimeBuild:
    """A built runtime in the cache: its archive and what ``runtime.json`` says."""

    directory: Path
    info: dict[str, object]

    @property
    def archive(self) -> Path:
        return self.directory / RUNTIME_ARCHIVE

    @property
    def digest(self) -> str:
        return str(self.info["digest"])


def runtime_build_dir(cache_dir: Path | None = None) -> Path:
    """Where this recipe's runtime lives in the cache."""
    root = cache_dir or cache_root()
    return root / "runtime" / f"{RUNTIME_SUITE}-py{RUNTIME_PYTHON_VERSION}-r{RUNTIME_RECIPE}"


def load_runtime_build(cache_dir: Path | None = None) -> RuntimeBuild | None:
    """The runtime built for this recipe, or None when there is none yet."""
    directory = runtime_build_dir(cache_dir)
    try:
        info = json.loads((directory / RUNTIME_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (directory / RUNTIME_ARCHIVE).is_file():
        return None
    return RuntimeBuild(directory, info)


def build_runtime(
    mirror_url: str,
    *,
    cache_dir: Path | None = None,
    log: Callable[[str], None] = print,
    force: bool = False,
) -> RuntimeBuild:
    """Build the runtime into the cache (once: an existing build is returned). Processes
    building at once wait on one build (a lock in the cache, across processes)."""
    existing = None if force else load_runtime_build(cache_dir)
    if existing is not None:
        return existing
    directory = runtime_build_dir(cache_dir)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with (directory.parent / "build.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Built by another process while this one waited: theirs.
        existing = None if force else load_runtime_build(cache_dir)
        if existing is not None:
            return existing
        return _build_runtime(mirror_url, directory, log)


def _build_runtime(mirror_url: str, directory: Path, log: Callable[[str], None]) -> RuntimeBuild:
    if os.geteuid() != 0:
        raise RuntimeBuildError("building the container runtime with debootstrap needs root")
    for tool, package in (("debootstrap", "debootstrap"), ("patchelf", "patchelf")):
        if shutil.which(tool) is None:
            raise RuntimeBuildError(
                f"cannot build the container runtime: {tool} is not installed "
                f"(apt-get install {package}, or run scripts/setup.sh)"
            )
    with tempfile.TemporaryDirectory(prefix="hx-runtime-", dir=directory.parent) as scratch:
        rootfs, tree = Path(scratch) / "rootfs", Path(scratch) / "tree"
        log(
            f"debootstrap --variant=minbase {RUNTIME_SUITE} with {', '.join(RUNTIME_PACKAGES)} "
            f"from {mirror_url} (about 30 s)"
        )
        done = subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(RUNTIME_PACKAGES)}",
                RUNTIME_SUITE,
                str(rootfs),
                mirror_url,
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise RuntimeBuildError(f"debootstrap failed (exit {done.returncode}):\n{tail}")
        _assemble(rootfs, tree)
        _smoke_test(tree)
        staged = Path(scratch) / "out"
        staged.mkdir()
        info = _write_archive(tree, staged / RUNTIME_ARCHIVE)
        (staged / RUNTIME_INFO).write_text(json.dumps(info, indent=2), encoding="utf-8")
        shutil.rmtree(directory, ignore_errors=True)
        staged.rename(directory)
    for older in directory.parent.glob("*-py*-r*"):  # other recipes: no longer loaded
        if older != directory:
            shutil.rmtree(older, ignore_errors=True)
    size = int(str(info["size"])) // 2**20
    log(f"container runtime: Python {info['python']}, {size} MiB, {directory}")
    return RuntimeBuild(directory, info)


# --------------------------------------------------------------------------- assembly


def _assemble(rootfs: Path, tree: Path) -> None:
    python_src = rootfs / "usr/bin" / _PY
    stdlib_src = rootfs / "usr/lib" / _PY
    if not python_src.is_file() or not stdlib_src.is_dir():
        raise RuntimeBuildError(f"{RUNTIME_SUITE}'s packages did not install {python_src}")
    (tree / "bin").mkdir(parents=True)
    (tree / "lib").mkdir()
    (tree / "python/bin").mkdir(parents=True)
    for name, source in (("tini", "usr/bin/tini-static"), ("busybox", "usr/bin/busybox")):
        path = rootfs / source
        if not path.is_file():
            path = rootfs / "bin" / Path(source).name
        shutil.copyfile(path, tree / "bin" / name)
        (tree / "bin" / name).chmod(0o111)  # execute-only: see the module docstring
    python = tree / "python/bin" / _PY
    shutil.copyfile(python_src, python)
    python.chmod(0o755)
    (tree / "python/bin/python3").symlink_to(_PY)
    stdlib = tree / "python/lib" / _PY
    shutil.copytree(
        stdlib_src,
        stdlib,
        symlinks=True,
        ignore=lambda _d, names: [
            n for n in names if n in _STDLIB_SKIP or n.startswith(("_test", "xxlimited"))
        ],
    )
    # Debian's site.py adds <prefix>/lib/python3/dist-packages: the one place the
    # runtime lets in more code, the bundle's dependency environment (its own volume).
    site = tree / "python/lib/python3/dist-packages"
    site.mkdir(parents=True)
    (site / "harbor-exec-deps.pth").write_text(DEPS_SITE + "\n", encoding="utf-8")
    tmux_src = rootfs / "usr/bin/tmux"
    if not tmux_src.is_file():
        raise RuntimeBuildError(f"{RUNTIME_SUITE}'s tmux package did not install {tmux_src}")
    objects = [python, rootfs / "usr/bin/setpriv", tmux_src, *stdlib.rglob("*.so")]
    for soname, path in _library_closure(rootfs, objects).items():
        shutil.copyfile(path, tree / "lib" / soname)
        (tree / "lib" / soname).chmod(0o755)
    setpriv = tree / "bin/setpriv"
    shutil.copyfile(rootfs / "usr/bin/setpriv", setpriv)
    setpriv.chmod(0o755)
    tmux = tree / "bin/tmux"
    shutil.copyfile(tmux_src, tmux)
    tmux.chmod(0o755)
    for program in (python, setpriv, tmux):
        _patchelf(
            "--set-interpreter",
            RUNTIME_LOADER,
            "--force-rpath",
            "--set-rpath",
            RUNTIME_LIB,
            program,
        )


def _patchelf(*args: str | Path) -> str:
    done = subprocess.run(["patchelf", *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeBuildError(f"patchelf {' '.join(map(str, args))}: {done.stderr.strip()}")
    return done.stdout


def _library_closure(rootfs: Path, objects: list[Path]) -> dict[str, Path]:
    """Every shared library ``objects`` need, transitively: ``{soname: file in rootfs}``."""
    found: dict[str, Path] = {}
    loader = _find_library(rootfs, _LOADER_NAME)
    found[_LOADER_NAME] = loader
    pending = list(objects)
    for soname in _MANYLINUX_LIBS:
        found[soname] = _find_library(rootfs, soname)
        pending.append(found[soname])
    while pending:
        for soname in _patchelf("--print-needed", pending.pop()).split():
            if soname in found:
                continue
            path = _find_library(rootfs, soname)
            found[soname] = path
            pending.append(path)
    return found


def _find_library(rootfs: Path, soname: str) -> Path:
    for directory in _LIB_DIRS:
        path = _inside(rootfs, rootfs / directory / soname)
        if path is not None:
            return path
    raise RuntimeBuildError(f"the runtime needs {soname}, which {RUNTIME_SUITE} did not install")


def _inside(rootfs: Path, path: Path) -> Path | None:
    """``path`` with its symlinks followed as inside ``rootfs`` (absolute ones too)."""
    for _ in range(40):
        if path.is_symlink():
            target = os.readlink(path)
            path = rootfs / target.lstrip("/") if target.startswith("/") else path.parent / target
        elif path.is_file():
            return path
        else:
            return None
    return None


def _host_run(tree: Path) -> list[str]:
    """Run the tree's interpreter on this host (its loader, its libraries, by path)."""
    return [
        str(tree / "lib" / _LOADER_NAME),
        "--library-path",
        str(tree / "lib"),
        str(tree / "python/bin" / _PY),
    ]


def _smoke_test(tree: Path) -> None:
    """Compile the stdlib ahead of time and check that what workflows use imports."""
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
    steps = (
        ["-I", "-m", "compileall", "-q", str(tree / "python/lib")],
        ["-I", "-c", "import asyncio, ctypes, decimal, hashlib, json, sqlite3, ssl, zlib, lzma"],
    )
    for step in steps:
        done = subprocess.run([*_host_run(tree), *step], capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise RuntimeBuildError(
                f"the runtime's Python failed {' '.join(step)}:\n{done.stderr[-2000:]}"
            )
    loader, lib = tree / "lib" / _LOADER_NAME, tree / "lib"
    tmux = [str(loader), "--library-path", str(lib), str(tree / "bin/tmux"), "-V"]
    done = subprocess.run(tmux, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not done.stdout.startswith("tmux "):
        raise RuntimeBuildError(f"the runtime's tmux failed -V:\n{done.stderr[-2000:]}")


def _members(tree: Path) -> Iterator[Path]:
    yield from sorted(p for p in tree.rglob("*") if p.relative_to(tree).as_posix() != RUNTIME_INFO)


def _write_archive(tree: Path, archive: Path) -> dict[str, object]:
    """The tree as one tar (``runtime.json`` last) and the info that names it: one walk
    reads each file once, for the archive and the digest."""
    digest = hashlib.sha256(f"recipe {RUNTIME_RECIPE}\0".encode())
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in _members(tree):
            relative = path.relative_to(tree).as_posix()
            member = tar.gettarinfo(str(path), relative)
            member.uid = member.gid = 0
            member.uname = member.gname = "root"
            member.mtime = int(path.lstat().st_mtime)
            digest.update(f"{relative}\0{path.lstat().st_mode:o}\0".encode())
            if member.issym():
                digest.update(member.linkname.encode())
                tar.addfile(member)
            elif member.isfile():
                data = path.read_bytes()
                digest.update(data)
                tar.addfile(member, io.BytesIO(data))
            else:
                tar.addfile(member)
        info: dict[str, object] = {
            "recipe": RUNTIME_RECIPE,
            "suite": RUNTIME_SUITE,
            "python": RUNTIME_PYTHON_VERSION,
            "mount": RUNTIME_MOUNT,
            "digest": digest.hexdigest(),
            "size": archive.stat().st_size,
        }
        data = json.dumps(info, indent=2).encode()
        member = tarfile.TarInfo(RUNTIME_INFO)
        member.size, member.mode = len(data), 0o644
        tar.addfile(member, io.BytesIO(data))
    return info


__all__ = [
    "RUNTIME_PACKAGES",
    "RUNTIME_SUITE",
    "RuntimeBuild",
    "RuntimeBuildError",
    "build_runtime",
    "load_runtime_build",
    "runtime_build_dir",
]
