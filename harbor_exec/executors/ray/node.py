"""The node side: one long-lived ``NodeAgent`` actor per Ray node with trial slots.

It wraps a ``LocalExecutor`` (the node's Docker runtime, image cache, reaper and
the model relays of its trials) and caches task snapshots, wheelhouses and
bundles by content key. What crosses between driver and node is typed: a
``NodeCall`` in (the plain ``TrialSpec``, object references to its content, its
``TrialSecrets`` sealed for this actor), then ``TrialPhase`` values and one
``NodeTrialRun`` out (the result, the exchange files' output and the usage as
values; the trial directory's files as a tar, for the server's trials directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import secrets as secrets_module
import shutil
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from harbor_exec.cache import cache_root
from harbor_exec.errors import TrialPhase
from harbor_exec.executors.base import ExecutorHealth, TrialHandle
from harbor_exec.executors.local import LocalExecutor
from harbor_exec.executors.ray.sealing import Opener
from harbor_exec.executors.ray.transfer import materialize, tar_dir
from harbor_exec.executors.spec import TrialContent, TrialSecrets
from harbor_exec.network.usage import ModelUsage
from harbor_exec.sandbox.archives import VERIFIER_OUTPUT_LIMITS, ArchiveEntry, OutputLimits
from harbor_exec.sandbox.deps import DepsLayer
from harbor_exec.tasks.task import Task
from harbor_exec.trial.outputs import TrialOutput
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec, deps_key, task_key
from harbor_exec.trial.warm import WarmStats

if TYPE_CHECKING:
    from harbor_exec.network.packages.cache import NodeCacheReport
    from harbor_exec.network.packages.service import PackageCacheConfig, PackageCacheService

#: The most a trial directory may weigh on its way back: its parts are bounded by
#: ``SandboxPolicy.output`` (the agent's) and ``verifier_output``; this bounds their
#: sum at the defaults, plus room for result.json and the runner's logs.
MAX_RESULT_BYTES = (
    OutputLimits().max_total_bytes + VERIFIER_OUTPUT_LIMITS.max_total_bytes + 32 * 2**20
)
#: Names a node for its containers' owner labels (default: the host name); a node
#: that returns under the same name reaps what its previous incarnation left.
NODE_NAME_ENV = "HARBOR_EXEC_NODE_NAME"


@dataclass(frozen=True)
class NodeCall:
    """One trial as it travels to a node: the plain spec, references to its
    content (each ``[ObjectRef]``: a nested reference is fetched only on a cache
    miss), and its secrets sealed for that node's actor."""

    spec: TrialSpec
    task_blob: list[Any]
    deps_blob: list[Any] = field(default_factory=list)
    bundle_blob: list[Any] = field(default_factory=list)  # the bundle's agent part
    sealed: bytes = b""  # pickle(TrialSecrets), sealed
    grader_blob: list[Any] = field(default_factory=list)  # its grader part, when that verifies
    #: The package cache's settings: the node's own service (``NodePackageCache``)
    #: goes into the spec's policy there; None: off.
    package_cache: PackageCacheConfig | None = None


@dataclass(frozen=True)
class NodeInfo:
    """Who a node's actor is and what its engine offers (asked once, when it joins)."""

    node_id: str
    name: str
    hostname: str
    pid_max: int
    cpus: int
    images: list[str]


@dataclass(frozen=True)
class NodeTrialRun:
    """A trial finished on a node."""

    result: TrialResult
    output: TrialOutput
    images_built: int
    usage: ModelUsage | None
    archive: bytes  # the trial directory's files (bounded by MAX_RESULT_BYTES)
    images: list[str] | None  # the node's images, when the trial built one
    timings: dict[str, float]
    package_cache: NodeCacheReport | None = None  # the node cache's totals after it
    warm: WarmStats | None = None  # the node's warm pool after it


@dataclass(frozen=True)
class NodePrewarm:
    built: int
    images: list[str]
    package_cache: NodeCacheReport | None = None  # the node cache's totals after it


def node_package_cache_config(config: PackageCacheConfig, node_name: str) -> PackageCacheConfig:
    """Where node ``node_name`` keeps its package cache: ``ray-nodes/<name>`` below the
    configured root (else the node's harbor-exec cache dir), so nodes sharing a
    machine (or a filesystem) never share a store, and a node that returns under its
    name finds its cache again."""
    return replace(config, root=(config.root or cache_root()) / "ray-nodes" / node_name)


class NodePackageCache:
    """One node process's package cache service, made on first use from the
    ``PackageCacheConfig`` that came with the work (the service itself, with its
    threads and its CA, never crosses the wire), shared by the node's trials and
    builds, closed with the node's actor."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self.service: PackageCacheService | None = None
        self._lock = threading.Lock()
        self._incarnation = secrets_module.token_hex(8)
        self._seq = 0

    def report(self) -> NodeCacheReport | None:
        """The service's totals so far, for the server's ``/metrics`` (None: no
        service yet). Taken here, host side: nothing a container wrote is read."""
        with self._lock:
            if self.service is None:
                return None
            from harbor_exec.network.packages.cache import NodeCacheReport

            self._seq += 1
            return NodeCacheReport(
                self.node_name, self._incarnation, self._seq, self.service.cache.totals()
            )

    def get(self, config: PackageCacheConfig) -> PackageCacheService:
        """The node's service (the first config's settings are kept). Blocking."""
        with self._lock:
            if self.service is None:
                # Imported here: the cache needs the server extra (httpx, cryptography).
                from harbor_exec.network.packages.service import PackageCacheService

                self.service = PackageCacheService(
                    node_package_cache_config(config, self.node_name)
                )
            return self.service

    async def service_for(self, config: PackageCacheConfig | None) -> PackageCacheService | None:
        """The node's service for work that came with ``config`` (None: the cache is off)."""
        if config is None:
            return None
        return await anyio.to_thread.run_sync(self.get, config)

    def close(self) -> None:
        with self._lock:
            service, self.service = self.service, None
        if service is not None:
            service.close()


class NodeAgent:
    """The long-lived actor on one node (see module doc)."""

    def __init__(self, cache_dir: str, reap_interval_sec: float = 5.0) -> None:
        import ray

        node_id: str = ray.get_runtime_context().get_node_id()
        from harbor_exec.sandbox.docker import DockerRuntime, current_owner

        # Owner labels name the node, so only this node's actors (this one, or a
        # later one once the node returns) reap what a dead actor here left; other
        # nodes sharing an engine leave those containers alone.
        name = (os.environ.get(NODE_NAME_ENV) or socket.gethostname()).replace("/", "_")
        runtime = DockerRuntime(owner=current_owner(f"ray-node:{name}"))
        with contextlib.suppress(Exception):
            runtime.reap_orphans()
        self._setup(
            node_id,
            name,
            Path(cache_dir) / node_id[:16],
            LocalExecutor(runtime, reap_interval_sec=reap_interval_sec),
        )

    def _setup(self, node_id: str, name: str, cache: Path, local: LocalExecutor) -> None:
        """What the actor holds, Ray and Docker aside (tests build one on a fake runtime)."""
        self.node_id = node_id
        self.name = name
        self.cache = cache
        self.cache.mkdir(parents=True, exist_ok=True)
        self._opener = Opener()
        self.local = local
        self.package_cache = NodePackageCache(name)
        self._handles: dict[str, TrialHandle] = {}
        self._cancelled: set[str] = set()
        self._bundles: dict[str, list[ArchiveEntry]] = {}

    def public_key(self) -> bytes:
        return self._opener.public

    async def info(self) -> NodeInfo:
        runtime = self.local.runtime
        pid_max, cpus = await anyio.to_thread.run_sync(
            lambda: (runtime.pid_max(), runtime.engine_cpus())
        )
        return NodeInfo(
            node_id=self.node_id,
            name=self.name,
            hostname=socket.gethostname(),
            pid_max=pid_max,
            cpus=cpus,
            images=await self._images(),
        )

    async def _images(self) -> list[str]:
        runtime = self.local.runtime
        infos = await anyio.to_thread.run_sync(runtime.list_images)
        return sorted({tag for info in infos for tag in _tags(info)})

    async def health(self) -> ExecutorHealth:
        return await anyio.to_thread.run_sync(self.local.health)

    async def _unpacked(self, kind: str, key: str, blob: Sequence[Any]) -> Path:
        """The tree of ``blob`` under ``<cache>/<kind>/<key>``, unpacked on first use."""
        root = self.cache / kind / key
        if not root.is_dir():
            data = await blob[0]
            root = await anyio.to_thread.run_sync(materialize, self.cache / kind, key, data)
        return root

    async def _bundle(self, key: str, blob: Sequence[Any]) -> list[ArchiveEntry]:
        """A part of a bundle (agent's or grader's: each has its own key), fetched once."""
        if key not in self._bundles:
            self._bundles[key] = pickle.loads(await blob[0])
        return self._bundles[key]

    async def _content(self, call: NodeCall) -> TrialContent:
        """This node's copies of what the call's spec names by key."""
        spec = call.spec
        wheelhouse = None
        if spec.deps is not None and call.deps_blob:
            wheelhouse = await self._unpacked("deps", deps_key(spec.deps), call.deps_blob)
        bundle: list[ArchiveEntry] = []
        if spec.bundle is not None and call.bundle_blob:
            bundle = await self._bundle(spec.bundle, call.bundle_blob)
        grader: list[ArchiveEntry] = []
        if spec.grader_bundle is not None and call.grader_blob:
            grader = await self._bundle(spec.grader_bundle, call.grader_blob)
        return TrialContent(
            task_root=await self._unpacked("tasks", task_key(spec.task), call.task_blob),
            wheelhouse=wheelhouse,
            bundle_files=bundle,
            grader_files=grader,
            trials_dir=self.cache / "trials" / secrets_module.token_hex(6),
        )

    async def run(self, call: NodeCall) -> AsyncIterator[TrialPhase | NodeTrialRun]:
        """Run one trial; yields each ``TrialPhase`` as it starts, then its ``NodeTrialRun``."""
        name = call.spec.trial_name or ""
        started = time.perf_counter()
        content = await self._content(call)
        secrets: TrialSecrets = pickle.loads(self._opener.open(call.sealed))
        prepared = time.perf_counter()
        phases: asyncio.Queue[TrialPhase] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_phase(phase: TrialPhase) -> None:
            loop.call_soon_threadsafe(phases.put_nowait, phase)

        self.local.cache_service = await self.package_cache.service_for(call.package_cache)
        handle = self.local.submit(call.spec, secrets=secrets, content=content, on_phase=on_phase)
        self._handles[name] = handle
        if name in self._cancelled:
            self.local.cancel(handle)
        result_task = asyncio.ensure_future(handle.result())
        try:
            while True:
                getter = asyncio.ensure_future(phases.get())
                done, _ = await asyncio.wait(
                    {getter, result_task}, return_when=asyncio.FIRST_COMPLETED
                )
                if getter in done:
                    yield getter.result()
                    continue
                getter.cancel()
                while not phases.empty():
                    yield phases.get_nowait()
                break
            run = result_task.result()
        finally:
            self._handles.pop(name, None)
            self._cancelled.discard(name)
        ran = time.perf_counter()
        scratch = content.trials_dir

        def pack() -> bytes:
            data = tar_dir(run.trial_dir, limit=MAX_RESULT_BYTES)
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            return data

        archive = await anyio.to_thread.run_sync(pack)
        # The image list (a Docker call) only changes when the trial built an image.
        images = await self._images() if run.images_built else None
        yield NodeTrialRun(
            result=run.result,
            output=run.output,
            images_built=run.images_built,
            usage=run.usage,
            archive=archive,
            images=images,
            timings={
                "node_prepare": prepared - started,
                "node_trial": ran - prepared,
                "node_pack": time.perf_counter() - ran,
            },
            package_cache=self.package_cache.report(),
            warm=self.local.warm_stats(),
        )

    def cancel(self, name: str) -> bool:
        self._cancelled.add(name)
        handle = self._handles.get(name)
        if handle is None:
            return False
        self.local.cancel(handle)
        return True

    async def prewarm(
        self,
        task: Task,
        task_blob: list[Any],
        deps: DepsLayer | None,
        deps_blob: list[Any],
        policy: SandboxPolicy | None = None,
        package_cache: PackageCacheConfig | None = None,
    ) -> NodePrewarm:
        """Build the task's image (and ``deps``) on this node; through the node's
        package cache when ``package_cache`` is given."""
        local_task = replace(task, files=await self._unpacked("tasks", task_key(task), task_blob))
        if deps is not None and deps_blob:
            wheelhouse = await self._unpacked("deps", deps_key(deps), deps_blob)
            deps = replace(deps, wheelhouse=wheelhouse)
        self.local.cache_service = await self.package_cache.service_for(package_cache)
        built = await self.local.prewarm(local_task, deps, policy)
        return NodePrewarm(
            built=built, images=await self._images(), package_cache=self.package_cache.report()
        )

    async def close(self) -> int:
        await self.local.aclose()
        # After the trials: their proxies hand traffic to it until they end.
        await anyio.to_thread.run_sync(self.package_cache.close)
        return 0


def _tags(info: Any) -> list[str]:
    tags = getattr(info, "tags", None)
    if tags:
        return [str(t) for t in tags]
    tag = getattr(info, "tag", None)
    return [str(tag)] if tag else []


__all__ = [
    "MAX_RESULT_BYTES",
    "NODE_NAME_ENV",
    "NodeAgent",
    "NodeCall",
    "NodeInfo",
    "NodePackageCache",
    "NodePrewarm",
    "NodeTrialRun",
    "node_package_cache_config",
]
