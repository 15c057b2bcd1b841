"""Collect the wheels the service image installs, on the host, for its CPython 3.13.

    .venv/bin/python scripts/service_wheels.py [DEST]     (default: build/service-wheels)

The Dockerfile installs from DEST with --no-index when it exists, so building the
image needs no registry (and no trust in the host's TLS set-up) inside the build. The
sandbox's sources (Docker's default seccomp profile from Debian's package, and the
read-only container runtime that `harbor-exec images bootstrap` built on this host) go
next to it, into build/service-sandbox, for the same reason.
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from harbor_exec.bundler.wheels import DEFAULT_PLATFORM, Target, build_wheel, download_wheels
from harbor_exec.sandbox.runtime_build import load_runtime_build
from harbor_exec.sandbox.seccomp import DOCKER_DEFAULT_PROFILE

ROOT = Path(__file__).resolve().parent.parent
#: The image's Python (python:3.13-slim-trixie) and the extras it installs (Dockerfile).
SERVICE_PYTHON = "3.13"
SERVICE_EXTRAS = ("server", "bundler", "native")


def main() -> int:
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "service-wheels"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = [
        *project["dependencies"],
        *(r for extra in SERVICE_EXTRAS for r in extras[extra]),
    ]
    shutil.rmtree(dest, ignore_errors=True)
    scratch = dest.parent / "service-wheel-build"
    shutil.rmtree(scratch, ignore_errors=True)
    own = build_wheel(ROOT, scratch, what="harbor-exec")
    wheels = download_wheels(
        [Requirement(r) for r in requirements],
        [own],
        dest,
        Target(SERVICE_PYTHON, DEFAULT_PLATFORM),
    )
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"{len(wheels)} wheels in {dest}")
    copy_sandbox_sources(dest.parent / "service-sandbox")
    return 0


def copy_sandbox_sources(dest: Path) -> None:
    """Docker's default seccomp profile (Debian's package, installed by scripts/setup.sh)
    and this host's container runtime, so the image's build needs no apt either."""
    shutil.rmtree(dest, ignore_errors=True)
    runtime = load_runtime_build()
    if not DOCKER_DEFAULT_PROFILE.is_file() or runtime is None:
        print(
            f"note: {DOCKER_DEFAULT_PROFILE} or the container runtime missing; the image uses apt"
        )
        return
    dest.mkdir(parents=True)
    shutil.copy2(DOCKER_DEFAULT_PROFILE, dest / "seccomp-default.json")
    shutil.copytree(runtime.directory, dest / "runtime")


if __name__ == "__main__":
    sys.exit(main())
