"""The runtime build's plain parts: where it lives, what it loads, libraries found inside
the root filesystem (never on the host), and the built runtime's own contents."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from harbor_exec.container.exchange import DEPS_SITE, RUNTIME_LOADER
from harbor_exec.sandbox import runtime_build
from harbor_exec.sandbox.runtime_build import (
    RuntimeBuildError,
    load_runtime_build,
    runtime_build_dir,
)


def test_no_build_until_both_files_are_there(tmp_path: Path) -> None:
    assert load_runtime_build(tmp_path) is None
    directory = runtime_build_dir(tmp_path)
    directory.mkdir(parents=True)
    (directory / "runtime.json").write_text(json.dumps({"digest": "d" * 64}))
    assert load_runtime_build(tmp_path) is None  # no archive yet
    (directory / "runtime.tar").write_bytes(b"")
    build = load_runtime_build(tmp_path)
    assert build is not None and build.digest == "d" * 64
    (directory / "runtime.json").write_text("{not json")
    assert load_runtime_build(tmp_path) is None


def test_libraries_resolve_inside_the_rootfs_even_through_absolute_links(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    libdir = rootfs / "usr/lib/x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    (libdir / "libz.so.1.3").write_bytes(b"\x7fELF")
    # An absolute link means the rootfs's own /usr/lib, not the host's.
    os.symlink("/usr/lib/x86_64-linux-gnu/libz.so.1.3", libdir / "libz.so.1")
    found = runtime_build._find_library(rootfs, "libz.so.1")
    assert found == libdir / "libz.so.1.3"
    os.symlink("/usr/lib/x86_64-linux-gnu/libc.so.6", libdir / "libc.so.6")  # dangling inside
    with pytest.raises(RuntimeBuildError, match=r"libc\.so\.6"):
        runtime_build._find_library(rootfs, "libc.so.6")


def test_the_built_runtime_holds_its_loader_init_and_interpreter() -> None:
    """The runtime this machine built (``scripts/setup.sh``): execute-only init and
    keep-alive, the patched interpreter's loader, the dependency environment's .pth."""
    build = load_runtime_build()
    if build is None:
        pytest.fail("no container runtime on this machine: run scripts/setup.sh")
    with tarfile.open(build.archive) as tar:
        names = tar.getnames()
        members = {m.name: m for m in tar.getmembers()}
        pth = tar.extractfile("python/lib/python3/dist-packages/harbor-exec-deps.pth")
        assert pth is not None and pth.read().decode().strip() == DEPS_SITE
        python = tar.extractfile("python/bin/python3.13")
        assert python is not None and RUNTIME_LOADER.encode() in python.read()
        tmux = tar.extractfile("bin/tmux")  # terminus-2's, patched like the interpreter
        assert tmux is not None and RUNTIME_LOADER.encode() in tmux.read()
    assert names[-1] == "runtime.json"  # last: a volume that has it is complete
    for program in ("bin/tini", "bin/busybox"):
        assert members[program].mode & 0o777 == 0o111, program
    assert "lib/ld-linux-x86-64.so.2" in names and "lib/libstdc++.so.6" in names
    assert not any(name.startswith("python/lib/python3.13/test/") for name in names)
