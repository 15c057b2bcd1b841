"""Fetching an in-container native agent's wheels (``harbor_exec.agents.native.layer``).

``prepare_agent_layer`` downloads the agent's pinned packages once per machine
(manylinux wheels for the read-only runtime's CPython, with the bundle machinery's
``download_wheels``, and native binaries from their npm packages, checked by the
registry's sha512, with ``harbor_exec.bundler.npm``) into the cache, beside this
harbor-exec's container side (the runtime wheel): the only step of a layer that
needs the network, run at prewarm or when the backend starts. ``load_agent_layer``
reads the cache only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from harbor_exec.agents.native.layer import (
    AGENT_LAYER_RECIPE,
    AGENT_PACKAGES,
    AgentLayer,
    AgentLayerError,
    AgentPackage,
    launchers,
)
from harbor_exec.bundler.cache import default_cache_dir, entry_lock, publish, work_dir
from harbor_exec.bundler.errors import BundleError
from harbor_exec.bundler.npm import fetch_npm_member
from harbor_exec.bundler.runtime import ensure_runtime_wheel, runtime_source
from harbor_exec.bundler.wheels import (
    DEFAULT_PLATFORM,
    Target,
    copy_or_link,
    download_wheels,
    platform_tags,
    read_wheel,
    sha256_file,
)
from harbor_exec.container.exchange import RUNTIME_PYTHON_VERSION

_INDEX = "index.json"
#: In a cache entry: the layer's native binaries, by program name.
_BINARIES = "binaries"


def _cache(cache_dir: Path | None) -> Path:
    return (cache_dir or default_cache_dir()).expanduser().resolve()


def _key(package: AgentPackage, platform: str) -> str:
    payload = {
        "recipe": AGENT_LAYER_RECIPE,
        "agent": package.agent,
        "requirements": list(package.requirements),
        "binaries": {
            name: [b.package, b.version, b.member] for name, b in sorted(package.binaries.items())
        },
        "python_version": RUNTIME_PYTHON_VERSION,
        "platform_tags": platform_tags(platform),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _package(agent: str) -> AgentPackage:
    package = AGENT_PACKAGES.get(agent)
    if package is None:
        raise AgentLayerError(
            f"no agent layer for {agent!r}: layers exist for {', '.join(AGENT_PACKAGES)}"
        )
    return package


def load_agent_layer(agent: str, cache_dir: Path | None = None) -> AgentLayer | None:
    """``agent``'s layer when its wheels are on this machine (never the network);
    None when they are not (``prepare_agent_layer`` fetches them)."""
    package = _package(agent)
    cache = _cache(cache_dir)
    entry = cache / "agents" / _key(package, DEFAULT_PLATFORM)[:32]
    index = entry / _INDEX
    if not index.is_file():
        return None
    data = json.loads(index.read_text(encoding="utf-8"))
    runtime_wheel = ensure_runtime_wheel(cache, runtime_source())
    local = entry / runtime_wheel.name
    if not local.is_file():  # this harbor-exec's container side, beside the wheels
        copy_or_link(runtime_wheel, local)
    wheels = (*data["wheels"], runtime_wheel.name)
    texts = launchers(package)
    digest = hashlib.sha256(
        json.dumps(
            {
                "recipe": AGENT_LAYER_RECIPE,
                "wheels": data["digest"],
                "binaries": data.get("binaries", {}),
                "runtime": runtime_wheel.name,
                "launchers": texts,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    return AgentLayer(
        agent=agent,
        wheelhouse=entry,
        wheels=tuple(sorted(wheels)),
        pip_wheel=data["pip_wheel"],
        programs=texts,
        digest=digest,
        binaries={name: entry / _BINARIES / name for name in package.binaries},
    )


def prepare_agent_layer(agent: str, cache_dir: Path | None = None) -> AgentLayer:
    """``agent``'s layer, its wheels downloaded first when this machine has none
    (the one step that needs the network: prewarm, or the backend's start)."""
    found = load_agent_layer(agent, cache_dir)
    if found is not None:
        return found
    package = _package(agent)
    cache = _cache(cache_dir)
    key = _key(package, DEFAULT_PLATFORM)
    entry = cache / "agents" / key[:32]
    with entry_lock(cache, "agent", key):
        if not (entry / _INDEX).is_file():  # not made while this process waited
            work = work_dir(cache, "agent-")
            try:
                wheelhouse = work / "wheelhouse"
                target = Target(RUNTIME_PYTHON_VERSION, DEFAULT_PLATFORM)
                roots = [Requirement(r) for r in package.requirements]
                try:
                    paths = download_wheels(roots, [], wheelhouse, target)
                except BundleError as exc:
                    raise AgentLayerError(f"{agent}'s agent layer: {exc}") from exc
                names = {read_wheel(p).name: p.name for p in paths}
                binaries: dict[str, str] = {}
                if package.binaries:
                    (wheelhouse / _BINARIES).mkdir()
                for name, binary in sorted(package.binaries.items()):
                    binary_path = wheelhouse / _BINARIES / name
                    try:
                        fetch_npm_member(binary.package, binary.version, binary.member, binary_path)
                    except BundleError as exc:
                        raise AgentLayerError(f"{agent}'s agent layer: {exc}") from exc
                    binaries[name] = sha256_file(binary_path)
                index = {
                    "agent": agent,
                    "requirements": list(package.requirements),
                    "wheels": sorted(p.name for p in paths),
                    "pip_wheel": names[canonicalize_name("pip")],
                    "digest": hashlib.sha256(
                        json.dumps(sorted((p.name, sha256_file(p)) for p in paths)).encode()
                    ).hexdigest(),
                    "binaries": binaries,  # name: sha256 of the binary
                }
                (wheelhouse / _INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")
                publish(wheelhouse, entry)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    layer = load_agent_layer(agent, cache_dir)
    assert layer is not None
    return layer


__all__ = ["load_agent_layer", "prepare_agent_layer"]
