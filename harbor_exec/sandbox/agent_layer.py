"""An in-container native agent's prebuilt layer: its program, installed once, mounted read-only.

Harbor installs mini-swe-agent at trial time (curl, uv, a downloaded CPython, PyPI),
which needs the internet and root in every trial. harbor-exec installs nothing at
trial time: the agent's pinned packages are downloaded once on this machine
(``harbor_exec.bundler.agent_wheels``: manylinux wheels for the read-only runtime's
CPython, the only step that needs the network, at prewarm or when the backend
starts), then
installed offline by the runtime's own Python into a named volume
(``ensure_agent_layer``, through ``harbor_exec.sandbox.deps.install_wheels``, the
bundle dependency machinery) named after its content
(``harbor-exec-agent-<name>-<digest>``), and mounted read-only at ``AGENT_MOUNT``
into the agent's container. Its launchers (``AGENT_BIN/<program>``) run on the
runtime's interpreter, so the agent runs on any image, musl or without Python.

The layer also holds harbor-exec's container side (the runtime wheel), whose
``runner forward`` pipes a loopback port in the container onto the rollout's relay.

This module holds the plain parts (what goes in, the volume, its install);
fetching the wheels is ``harbor_exec.bundler.agent_wheels``. A trial gets the layer
as a value in its request: nothing at trial time touches the network.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from harbor_exec.container.exchange import AGENT_BIN, AGENT_MOUNT, AGENT_SITE, RUNTIME_PYTHON
from harbor_exec.sandbox.deps import WheelInstall, install_wheels
from harbor_exec.sandbox.runtime import ContainerRuntime

AGENT_VOLUME_PREFIX = "harbor-exec-agent-"
#: In the volume, written last: its presence says the layer is complete.
AGENT_MARKER = f"{AGENT_MOUNT}/installed.txt"
#: Bump when the layer's layout or install changes: a new volume.
AGENT_LAYER_RECIPE = 1


@dataclass(frozen=True)
class AgentPackage:
    """What one in-container agent needs: pinned requirements, and its programs as
    ``{name: "module:function"}`` (launchers in ``AGENT_BIN``)."""

    agent: str
    requirements: tuple[str, ...]
    programs: Mapping[str, str]


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
}


class AgentLayerError(RuntimeError):
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


@dataclass(frozen=True)
class AgentLayer:
    """One agent's layer as plain values: the wheels on this machine and the volume
    they go into."""

    agent: str
    wheelhouse: Path
    wheels: tuple[str, ...]  # file names in ``wheelhouse``, the runtime wheel included
    pip_wheel: str
    programs: Mapping[str, str]
    digest: str

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
            launchers={self.program(n): launcher(e) for n, e in self.programs.items()},
        )


def ensure_agent_layer(
    runtime: ContainerRuntime, layer: AgentLayer, image: str
) -> tuple[str, bool]:
    """The layer's volume on ``runtime``'s engine, installed offline when it is not
    complete; returns ``(volume, installed_now)``."""
    return layer.volume_name, install_wheels(runtime, layer.install(), image)


__all__ = [
    "AGENT_LAYER_RECIPE",
    "AGENT_MARKER",
    "AGENT_PACKAGES",
    "AGENT_VOLUME_PREFIX",
    "AgentLayer",
    "AgentLayerError",
    "AgentPackage",
    "ensure_agent_layer",
    "launcher",
]
