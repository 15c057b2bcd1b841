"""An in-container native agent's prebuilt layer: its program, installed once, mounted read-only.

Harbor installs mini-swe-agent (curl, uv, a downloaded CPython, PyPI) and opencode
(curl, nvm, Node, npm) at trial time, which needs the internet and root in every
trial. harbor-exec installs nothing at trial time: the agent's pinned packages are
downloaded once on this machine (``harbor_exec.bundler.agent_wheels``: manylinux
wheels for the read-only runtime's CPython, and opencode's prebuilt binary from its
npm package, the only step that needs the network, at prewarm or when the backend
starts), then installed offline by the runtime's own Python into a named volume
(``ensure_agent_layer``, through ``harbor_exec.sandbox.deps.install_wheels``, the
bundle dependency machinery) named after its content
(``harbor-exec-agent-<name>-<digest>``), and mounted read-only at ``AGENT_MOUNT``
into the agent's container. Its launchers (``AGENT_BIN/<program>``) run on the
runtime's interpreter, or (a native binary) on the runtime's glibc loader, so the
agent runs on any image, musl or without Python or Node.

The layer also holds harbor-exec's container side (the runtime wheel), whose
``runner forward`` pipes a loopback port in the container onto the rollout's relay.

This module holds the plain parts (what goes in, the volume, its install);
fetching the wheels is ``harbor_exec.bundler.agent_wheels``. A trial gets the layer
as a value in its request: nothing at trial time touches the network.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from harbor_exec.container.exchange import (
    AGENT_BIN,
    AGENT_MOUNT,
    AGENT_SITE,
    RUNTIME_BUSYBOX,
    RUNTIME_LIB,
    RUNTIME_LOADER,
    RUNTIME_PYTHON,
)
from harbor_exec.errors import HarborExecError
from harbor_exec.sandbox.deps import WheelInstall, install_wheels
from harbor_exec.sandbox.runtime import ContainerRuntime

AGENT_VOLUME_PREFIX = "harbor-exec-agent-"
#: In the volume, written last: its presence says the layer is complete.
AGENT_MARKER = f"{AGENT_MOUNT}/installed.txt"
#: Where a layer's native binaries live (their launchers are in ``AGENT_BIN``).
AGENT_LIBEXEC = f"{AGENT_MOUNT}/libexec"
#: Bump when the layer's layout or install changes: a new volume.
AGENT_LAYER_RECIPE = 1


@dataclass(frozen=True)
class NpmBinary:
    """A prebuilt program inside an npm package's tarball, pinned (``member`` is its
    path in the tarball); checked against the registry's sha512 integrity."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class AgentPackage:
    """What one in-container agent needs: pinned requirements, and its programs:
    ``programs`` as ``{name: "module:function"}`` (Python), ``binaries`` as
    ``{name: NpmBinary}`` (native, glibc), ``scripts`` as ``{name: shell text}`` (run
    by the runtime's busybox); every one a launcher in ``AGENT_BIN``."""

    agent: str
    requirements: tuple[str, ...]
    programs: Mapping[str, str]
    binaries: Mapping[str, NpmBinary] = field(default_factory=dict)
    scripts: Mapping[str, str] = field(default_factory=dict)

    @property
    def program_names(self) -> tuple[str, ...]:
        return (*self.programs, *self.binaries, *self.scripts)


#: opencode's version: Harbor 0.26 installs ``opencode-ai@latest``; this was the
#: latest stable release when pinned.
OPENCODE_VERSION = "1.18.33"
#: ``stdbuf`` for images without coreutils (busybox): Harbor pipes opencode's output
#: through ``stdbuf -oL tee``; tee does not buffer, so the options are dropped.
_STDBUF_SHIM = """while [ $# -gt 0 ]; do
  case "$1" in -i|-o|-e) shift 2 ;; -*) shift ;; *) break ;; esac
done
exec "$@"
"""


#: Harbor 0.26's mini-swe-agent adapter installs ``mini-swe-agent`` (2.x) with
#: ``litellm[mcp]``, orjson and fastapi; the same set, pinned. pydantic is there for
#: harbor-exec's own container side (installed without dependencies).
AGENT_PACKAGES: Mapping[str, AgentPackage] = {
    "mini-swe-agent": AgentPackage(
        agent="mini-swe-agent",
        requirements=(
            "mini-swe-agent==2.4.6",
            "litellm[mcp]==1.110.2",
            "orjson==3.13.0",
            "fastapi==0.165.0",
            "pydantic>=2.7",
            "pip",
        ),
        programs={"mini-swe-agent": "minisweagent.run.mini:app"},
    ),
    # opencode is a Bun-compiled binary (its JavaScript in an ELF section) linked
    # against glibc only: the baseline x64 build (no AVX2 needed) runs on the
    # runtime's loader and libraries on any image. Its OpenAI-compatible provider
    # (@ai-sdk/openai-compatible) is compiled in: nothing is fetched at run time.
    # pydantic and pip are for harbor-exec's own container side (the forwarder).
    "opencode": AgentPackage(
        agent="opencode",
        requirements=("pydantic>=2.7", "pip"),
        programs={},
        binaries={
            "opencode": NpmBinary(
                package="opencode-linux-x64-baseline",
                version=OPENCODE_VERSION,
                member="package/bin/opencode",
            )
        },
        scripts={"stdbuf": _STDBUF_SHIM},
    ),
}


class AgentLayerError(HarborExecError, RuntimeError):
    """The agent's layer cannot be prepared here (no such agent, or the download failed)."""


def launcher(entry: str) -> str:
    """A program of the layer: the runtime's interpreter, isolated (no ``PYTHON*``
    variable, no user site), with the layer's packages after the standard library."""
    module, _, function = entry.partition(":")
    return (
        f"#!{RUNTIME_PYTHON} -I\n"
        "import sys\n"
        f"sys.path.append({AGENT_SITE!r})\n"
        f"from {module} import {function}\n"
        f"sys.exit({function}())\n"
    )


def native_launcher(name: str) -> str:
    """A native program of the layer, run by the runtime's glibc loader with the
    runtime's libraries (the image's libc, musl or none, never takes part; what the
    program starts runs on the image's own, no ``LD_*`` variable set)."""
    return (
        f"#!{RUNTIME_BUSYBOX} sh\n"
        f'exec {RUNTIME_LOADER} --library-path {RUNTIME_LIB} {AGENT_LIBEXEC}/{name} "$@"\n'
    )


def script_launcher(text: str) -> str:
    """A shell program of the layer, run by the runtime's busybox."""
    return f"#!{RUNTIME_BUSYBOX} sh\n{text}"


def launchers(package: AgentPackage) -> dict[str, str]:
    """Every launcher of ``package``: its name (in ``AGENT_BIN``) and its text."""
    texts = {name: launcher(entry) for name, entry in package.programs.items()}
    texts.update({name: native_launcher(name) for name in package.binaries})
    texts.update({name: script_launcher(text) for name, text in package.scripts.items()})
    return dict(sorted(texts.items()))


@dataclass(frozen=True)
class AgentLayer:
    """One agent's layer as plain values: the wheels and binaries on this machine and
    the volume they go into."""

    agent: str
    wheelhouse: Path
    wheels: tuple[str, ...]  # file names in ``wheelhouse``, the runtime wheel included
    pip_wheel: str
    programs: Mapping[str, str]  # name: launcher text
    digest: str
    #: Native binaries: name (placed as ``AGENT_LIBEXEC/<name>``): host file.
    binaries: Mapping[str, Path] = field(default_factory=dict)

    @property
    def volume_name(self) -> str:
        return f"{AGENT_VOLUME_PREFIX}{self.agent}-{self.digest[:16]}"

    def program(self, name: str) -> str:
        """The container path of the layer's program ``name``."""
        return f"{AGENT_BIN}/{name}"

    def install(self) -> WheelInstall:
        return WheelInstall(
            volume=self.volume_name,
            mount=AGENT_MOUNT,
            site=AGENT_SITE,
            marker=AGENT_MARKER,
            wheels=tuple(self.wheelhouse / w for w in self.wheels),
            pip_wheel=self.pip_wheel,
            kind="agent",
            launchers={self.program(n): text for n, text in self.programs.items()},
            files=tuple((p, f"{AGENT_LIBEXEC}/{n}") for n, p in sorted(self.binaries.items())),
        )


def ensure_agent_layer(
    runtime: ContainerRuntime, layer: AgentLayer, image: str
) -> tuple[str, bool]:
    """The layer's volume on ``runtime``'s engine, installed offline when it is not
    complete; returns ``(volume, installed_now)``."""
    return layer.volume_name, install_wheels(runtime, layer.install(), image)


__all__ = [
    "AGENT_LAYER_RECIPE",
    "AGENT_LIBEXEC",
    "AGENT_MARKER",
    "AGENT_PACKAGES",
    "AGENT_VOLUME_PREFIX",
    "OPENCODE_VERSION",
    "AgentLayer",
    "AgentLayerError",
    "AgentPackage",
    "NpmBinary",
    "ensure_agent_layer",
    "launcher",
    "launchers",
    "native_launcher",
    "script_launcher",
]
