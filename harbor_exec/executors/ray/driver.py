"""The driver side: ``RayExecutor``, a ``TrialExecutor`` over the nodes of a Ray cluster.

The server stays the single control plane (admission, queue, status, cancel). The
node table is re-read every second; each node offering ``harbor_exec_trial`` slots
gets one ``NodeAgent`` (``harbor_exec.executors.ray.node``). A trial's spec goes
as is, its content by reference through the object store (once per key), its
secrets sealed for the node (``harbor_exec.executors.ray.sealing``); its result
comes back as values, and the trial directory's files as a tar written under the
server's trials directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import secrets as secrets_module
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.to_thread

from harbor_exec.errors import HarborExecError, RayNodeLostError, RayUnavailableError, TrialPhase
from harbor_exec.executors.base import (
    AsyncTrialExecutor,
    AsyncTrialHandle,
    ExecutorHealth,
    TrialHandle,
    TrialRun,
)
from harbor_exec.executors.ray.node import NodeAgent, NodeCall, NodeInfo, NodePrewarm, NodeTrialRun
from harbor_exec.executors.ray.sealing import seal
from harbor_exec.executors.ray.transfer import tar_dir, untar
from harbor_exec.executors.spec import TrialContent, TrialSecrets
from harbor_exec.protocol import NodeStatus
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.sandbox.deps import DepsLayer
from harbor_exec.tasks.task import Task
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec, deps_key, task_key
from harbor_exec.trial.trial import PhaseCallback, image_tag_for, new_trial_name
from harbor_exec.trial.warm import WarmStats, report_node, summed

if TYPE_CHECKING:
    from harbor_exec.network.packages.cache import NodeCacheReport
    from harbor_exec.network.packages.service import PackageCacheConfig, PackageCacheService

logger = logging.getLogger(__name__)

TRIAL_RESOURCE = "harbor_exec_trial"
NAMESPACE = "harbor-exec"
REFRESH_SEC = 1.0
CALL_TIMEOUT_SEC = 30.0
#: The node table read is the server's heartbeat to the cluster: unanswered this
#: long, the cluster counts as unreachable (admissions get 503) until it answers.
UNREACHABLE_AFTER_SEC = 5.0
#: How long the server's Ray driver keeps retrying a GCS that went away before Ray
#: ends the process (Ray's default is 60 s); the server must outlive an outage.
GCS_RECONNECT_SEC = 7 * 24 * 3600


# --------------------------------------------------------------------------- server side


@dataclass
class _Node:
    node_id: str
    address: str
    slots: int
    actor: Any
    public_key: bytes
    name: str = ""
    pid_max: int = 4_194_304
    cpus: int = 1
    in_use: int = 0
    alive: bool = True
    images: set[str] = field(default_factory=set)
    trials: int = 0
    warm: WarmStats | None = None  # its warm pool, as its last trial reported it

    @property
    def short(self) -> str:
        return self.node_id[:12]


@dataclass(eq=False)
class _RayHandle(AsyncTrialHandle):
    node: _Node | None = field(default=None, init=False)
    phase: TrialPhase | None = field(default=None, init=False)
    cancelled: bool = field(default=False, init=False)


class RayExecutor(AsyncTrialExecutor[_RayHandle]):
    """Trials on the Ray nodes that offer ``harbor_exec_trial`` slots (see module doc).

    ``connect()`` joins the cluster (``address``: ``host:port`` of the head, or
    ``auto``) and raises ``RayUnavailableError`` with a clear message when it cannot;
    every other method connects on first use.
    """

    def __init__(
        self,
        address: str = "auto",
        *,
        cache_dir: str | None = None,
        namespace: str = NAMESPACE,
        reap_interval_sec: float = 5.0,
        connect_timeout_sec: float = 10.0,
        package_cache: PackageCacheConfig | None = None,
    ) -> None:
        super().__init__()
        self.address = address
        #: The package cache's settings: each node runs a service of its own from
        #: them (``NodePackageCache``) for its trials and builds; None: off.
        self.package_cache = package_cache
        self.cache_dir = cache_dir or str(Path(tempfile.gettempdir()) / "harbor-exec-ray")
        self.namespace = namespace
        self.reap_interval_sec = reap_interval_sec
        self.connect_timeout_sec = connect_timeout_sec
        self._nodes: dict[str, _Node] = {}
        self._lock = threading.Lock()
        self._connected = False
        self._unreachable: str | None = None
        self._asking_since: float | None = None
        self._timings: dict[str, list[float]] = {}
        self._blobs: dict[str, Any] = {}  # content key -> ObjectRef
        # Set when a slot may have freed (or the node table changed).
        self._slot_freed = asyncio.Event()
        self._owner = f"{socket.gethostname()}-{os.getpid()}-{secrets_module.token_hex(3)}"

    # ----------------------------------------------------------------- cluster

    def connect(self) -> None:
        """Join the cluster and start one actor per trial node (idempotent)."""
        if self._connected:
            return
        import ray

        if self.address != "auto" and ":" in self.address:
            host, _, port = self.address.rpartition(":")
            try:
                with socket.create_connection(
                    (host.removeprefix("ray://"), int(port)), timeout=self.connect_timeout_sec
                ):
                    pass
            except (OSError, ValueError) as exc:
                raise RayUnavailableError(
                    f"cannot reach the Ray cluster at {self.address}: {exc}; start its head "
                    "with `ray start --head` (see docs/ray.md) or pass --ray auto on a node "
                    "of a running cluster"
                ) from None
        # Read by the driver's core worker at init: outlive a GCS outage.
        os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(GCS_RECONNECT_SEC))
        try:
            if not ray.is_initialized():
                ray.init(
                    address=self.address,
                    namespace=self.namespace,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                    configure_logging=False,
                )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayUnavailableError(
                f"cannot connect to the Ray cluster at {self.address}: {exc}"
            ) from None
        self._connected = True
        self._refresh_sync()

    def _node_table(self) -> list[dict[str, Any]]:
        import ray

        return [
            n
            for n in cast(Any, ray).nodes()
            if n.get("Alive") and n.get("Resources", {}).get(TRIAL_RESOURCE, 0) > 0
        ]

    def _refresh_sync(self) -> None:
        """Read the node table; start actors on new trial nodes, drop dead ones."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._asking_since = time.monotonic()
        try:
            table = self._node_table()
        except Exception as exc:
            self._unreachable = f"the Ray cluster at {self.address} is unreachable: {exc}"
            return
        finally:
            self._asking_since = None
        if self._unreachable is not None:
            logger.warning("the Ray cluster at %s answers again", self.address)
        self._unreachable = None
        alive = {n["NodeID"]: n for n in table}
        with self._lock:
            for node_id, node in self._nodes.items():
                if node_id not in alive and node.alive:
                    node.alive = False
                    logger.warning("Ray node %s left the cluster", node.short)
            new = [n for n in alive if n not in self._nodes or not self._nodes[n].alive]
        for node_id in new:
            entry = alive[node_id]
            agent_cls: Any = ray.remote(NodeAgent)
            actor: Any = agent_cls.options(
                name=f"hx-node-{node_id[:16]}-{self._owner}",
                namespace=self.namespace,
                num_cpus=0,
                max_concurrency=1000,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self.cache_dir, self.reap_interval_sec)
            try:
                public_key, info = ray.get(
                    [actor.public_key.remote(), actor.info.remote()], timeout=CALL_TIMEOUT_SEC
                )
                assert isinstance(info, NodeInfo)
            except Exception as exc:
                logger.warning("Ray node %s: its actor did not start: %s", node_id[:12], exc)
                with contextlib.suppress(Exception):
                    ray.kill(actor)
                continue
            node = _Node(
                node_id=node_id,
                address=str(entry.get("NodeManagerAddress", "")),
                slots=int(entry["Resources"][TRIAL_RESOURCE]),
                actor=actor,
                public_key=public_key,
                name=info.name,
                pid_max=info.pid_max,
                cpus=info.cpus,
                images=set(info.images),
            )
            with self._lock:
                self._nodes[node_id] = node
            logger.info("Ray node %s joined with %d trial slot(s)", node.short, node.slots)
        self._slot_freed.set()

    async def _background(self) -> None:
        """Re-read the node table every ``REFRESH_SEC`` on a thread of its own, one read
        at a time; a read unanswered for ``UNREACHABLE_AFTER_SEC`` marks the cluster
        unreachable (a hung GCS blocks the read; the server keeps answering)."""
        loop = asyncio.get_running_loop()
        pending: asyncio.Future[None] | None = None
        while not self._closed:
            await asyncio.sleep(REFRESH_SEC)
            if pending is not None and pending.done():
                with contextlib.suppress(asyncio.CancelledError):
                    if (exc := pending.exception()) is not None:
                        logger.warning("refreshing the Ray node table failed: %s", exc)
                pending = None
            if pending is None:
                pending = self._refresh_in_thread(loop)
                continue
            since = self._asking_since
            if since is not None and time.monotonic() - since > UNREACHABLE_AFTER_SEC:
                if self._unreachable is None:
                    logger.warning("the Ray cluster at %s does not answer", self.address)
                self._unreachable = (
                    f"the Ray cluster at {self.address} has not answered for "
                    f"{time.monotonic() - since:.0f}s (its GCS is down or hung)"
                )

    def _refresh_in_thread(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """``_refresh_sync`` on a daemon thread (a read hung on a dead GCS must not
        hold up the server's exit)."""
        future: asyncio.Future[None] = loop.create_future()

        def settle(exc: BaseException | None) -> None:
            if not future.done():
                if exc is None:
                    future.set_result(None)
                else:
                    future.set_exception(exc)

        def work() -> None:
            outcome: BaseException | None = None
            try:
                self._refresh_sync()
            except Exception as exc:
                outcome = exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, outcome)

        threading.Thread(target=work, name="hx-ray-refresh", daemon=True).start()
        return future

    def package_cache_service(self, config: PackageCacheConfig) -> PackageCacheService | None:
        """None: trials and builds run on the nodes, each with a cache of its own."""
        self.package_cache = config
        return None

    def _for_nodes(
        self, policy: SandboxPolicy | None
    ) -> tuple[SandboxPolicy, PackageCacheConfig | None]:
        """``policy`` as it travels (plain data) and the cache settings each node makes
        its own service from."""
        return policy or SandboxPolicy(), self.package_cache

    def live_nodes(self) -> list[_Node]:
        with self._lock:
            return [n for n in self._nodes.values() if n.alive]

    # ----------------------------------------------------------------- blobs

    async def _blob(self, key: str, make: Callable[[], bytes]) -> Any:
        """The object reference holding ``make()``, put in the object store once per key."""
        ref = self._blobs.get(key)
        if ref is None:
            import ray

            data = await anyio.to_thread.run_sync(make)
            ref = self._blobs.setdefault(key, ray.put(data))
        return ref

    async def _task_blob(self, task: Task, root: Path) -> list[Any]:
        return [await self._blob(task_key(task), lambda: tar_dir(root))]

    async def _deps_blob(self, deps: DepsLayer | None, wheelhouse: Path | None) -> list[Any]:
        if deps is None:
            return []
        root = wheelhouse or deps.wheelhouse
        return [await self._blob(deps_key(deps), lambda: tar_dir(root))]

    async def _files_blob(self, key: str | None, files: Sequence[ArchiveEntry]) -> list[Any]:
        if key is None:
            return []
        entries = list(files)
        return [await self._blob(key, lambda: pickle.dumps(entries))]

    async def _content_refs(
        self, handle: _RayHandle
    ) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        """References to the trial's task snapshot, wheelhouse and the bundle's agent
        and grader parts, each put in the object store once per content key."""
        spec, content = handle.spec, handle.content
        return (
            await self._task_blob(spec.task, content.task_root or spec.task.root),
            await self._deps_blob(spec.deps, content.wheelhouse),
            await self._files_blob(spec.bundle, content.bundle_files),
            await self._files_blob(spec.grader_bundle, content.grader_files),
        )

    # ----------------------------------------------------------------- trials

    @property
    def trials_run_here(self) -> bool:
        return False

    def _new_handle(
        self,
        spec: TrialSpec,
        secrets: TrialSecrets,
        content: TrialContent,
        on_phase: PhaseCallback | None,
    ) -> _RayHandle:
        if spec.trial_name is None:  # the node agent cancels trials by name
            spec = replace(spec, trial_name=new_trial_name(spec.task.name))
        return _RayHandle(spec, secrets, content, on_phase)

    def _image_key(self, task: Task) -> str:
        env = task.config.environment
        return image_tag_for(task) if task.dockerfile is not None else str(env.docker_image)

    async def _acquire(self, handle: _RayHandle) -> _Node:
        image = handle.spec.image or self._image_key(handle.spec.task)
        while True:
            if handle.cancelled:
                raise asyncio.CancelledError
            free = [n for n in self.live_nodes() if n.in_use < n.slots]
            if free:
                node = min(free, key=lambda n: (image not in n.images, n.in_use / n.slots))
                node.in_use += 1
                return node
            self._slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), timeout=REFRESH_SEC)

    def _release(self, node: _Node) -> None:
        node.in_use = max(0, node.in_use - 1)
        self._slot_freed.set()

    async def _run(self, handle: _RayHandle) -> TrialRun:
        import ray

        if not self._connected:
            await anyio.to_thread.run_sync(self.connect)
        spec = handle.spec
        setup = time.perf_counter()
        task_blob, deps_blob, bundle_blob, grader_blob = await self._content_refs(handle)
        node = await self._acquire(handle)
        handle.node = node
        node.trials += 1
        placed = time.perf_counter()
        try:
            policy, package_cache = self._for_nodes(spec.policy)
            call = NodeCall(
                spec=replace(spec, policy=policy),
                package_cache=package_cache,
                task_blob=task_blob,
                deps_blob=deps_blob,
                bundle_blob=bundle_blob,
                grader_blob=grader_blob,
                sealed=seal(node.public_key, pickle.dumps(handle.secrets)),
            )
            done: NodeTrialRun | None = None
            try:
                stream = node.actor.run.options(num_returns="streaming").remote(call)
                if handle.cancelled:
                    node.actor.cancel.remote(handle.name)
                async for ref in stream:
                    value = await ref
                    if isinstance(value, NodeTrialRun):
                        done = value
                        continue
                    handle.phase = TrialPhase(value)
                    if handle.on_phase is not None:
                        handle.on_phase(handle.phase)
            except asyncio.CancelledError:
                node.actor.cancel.remote(handle.name)
                raise
            except ray.exceptions.RayError as exc:
                if isinstance(exc, ray.exceptions.RayTaskError) and not isinstance(
                    exc, ray.exceptions.RayActorError
                ):
                    raise HarborExecError(
                        f"the trial failed on Ray node {node.short}: {exc}"
                    ) from None
                node.alive = False
                during = f"during the {handle.phase} phase" if handle.phase else "before it started"
                raise RayNodeLostError(
                    f"Ray node {node.short} ({node.address}) was lost {during}"
                ) from None
            if done is None:
                raise RayNodeLostError(f"Ray node {node.short} ended the trial without a result")
        finally:
            self._release(node)
        finished = done  # narrowed, for the closure below
        _count_node_cache(finished.package_cache)
        if finished.warm is not None:
            node.warm = finished.warm
            report_node(node.short, finished.warm)
        if finished.images is not None:
            node.images.update(finished.images)
        elif (image := spec.image or self._image_key(spec.task)) is not None:
            node.images.add(image)  # it ran there, so the node has it now
        trial_dir = spec.trials_dir / handle.name
        back = time.perf_counter()
        scrub = handle.secrets.scrub
        result = await anyio.to_thread.run_sync(
            lambda: self._write_back(trial_dir, finished, node, scrub)
        )
        timings = dict(finished.timings)
        timings["server_setup_and_place"] = placed - setup
        timings["server_remote"] = back - placed
        timings["server_write_back"] = time.perf_counter() - back
        # What the remote call cost beyond the node's own work: Ray's share.
        timings["ray_transport"] = timings["server_remote"] - sum(
            v for k, v in timings.items() if k.startswith("node_")
        )
        self._record(timings)
        return TrialRun(
            result,
            trial_dir,
            finished.images_built,
            node=node.node_id,
            usage=finished.usage,
            output=finished.output,
        )

    def _record(self, timings: dict[str, float]) -> None:
        for key, value in timings.items():
            samples = self._timings.setdefault(key, [])
            samples.append(value)
            del samples[:-1000]

    def timings(self) -> dict[str, float]:
        """Median milliseconds per part of a remote trial (the last 1000 trials)."""
        import statistics

        return {k: round(statistics.median(v) * 1000, 2) for k, v in self._timings.items() if v}

    def _write_back(
        self, trial_dir: Path, done: NodeTrialRun, node: _Node, scrub: Sequence[str]
    ) -> TrialResult:
        """The trial directory's files under ``trial_dir``, and its ``result.json``
        rewritten to say where it is now and which node ran it."""
        untar(done.archive, trial_dir)
        result = done.result.model_copy(
            update={
                "trial_uri": trial_dir.resolve().as_uri(),
                "config": {
                    **done.result.config,
                    "trials_dir": str(trial_dir.parent),
                    "node": {"ray_node_id": node.node_id, "address": node.address},
                },
            }
        )
        result.write(trial_dir, redacting=scrub)
        return result

    def cancel(self, handle: TrialHandle) -> None:
        assert isinstance(handle, _RayHandle)
        handle.cancelled = True
        if handle.node is not None and handle.node.alive:
            handle.node.actor.cancel.remote(handle.name)
        self._slot_freed.set()

    # ----------------------------------------------------------------- health

    def nodes(self) -> list[NodeStatus]:
        with self._lock:
            known = list(self._nodes.values())
        return [
            NodeStatus(
                node=n.short,
                node_id=n.node_id,
                name=n.name,
                address=n.address,
                alive=n.alive,
                slots=n.slots,
                in_use=n.in_use,
                trials=n.trials,
                images=len(n.images),
                warm_containers=n.warm.idle if n.warm is not None else None,
            )
            for n in known
        ]

    def health(self) -> ExecutorHealth:
        self._start_background()
        reason = self.available()
        images: dict[str, int] = {}
        for node in self.live_nodes():
            for tag in node.images:
                kind = tag.split(":")[0].removeprefix("harbor-exec/")
                images[kind] = images.get(kind, 0) + 1
        return ExecutorHealth(
            available=reason is None,
            reason=reason,
            images=images,
            builder=f"ray:{self.address}",
            nodes=self.nodes(),
            warm=summed([n.warm for n in self.live_nodes() if n.warm is not None]),
        )

    def available(self) -> str | None:
        self._start_background()
        if not self._connected:
            try:
                self.connect()
            except RayUnavailableError as exc:
                return str(exc)
        if self._unreachable is not None:
            return self._unreachable + "; rollouts are admitted again once it answers"
        if not self.live_nodes():
            return (
                f"no node of the Ray cluster at {self.address} offers {TRIAL_RESOURCE} slots "
                f"(start workers with --resources '{{\"{TRIAL_RESOURCE}\": N}}')"
            )
        return None

    def pid_max(self) -> int:
        self.connect()
        nodes = self.live_nodes()
        return min((n.pid_max for n in nodes), default=4_194_304)

    def default_prewarm_jobs(self) -> int:
        self.connect()
        return max((n.cpus for n in self.live_nodes()), default=1)

    async def prewarm(
        self, task: Task, deps: DepsLayer | None, policy: SandboxPolicy | None = None
    ) -> int:
        report = await self.prewarm_nodes(task, deps, policy=policy)
        errors = [v for v in report.values() if isinstance(v, str)]
        if errors:
            raise HarborExecError("; ".join(errors))
        return sum(v for v in report.values() if isinstance(v, int))

    async def prewarm_nodes(
        self,
        task: Task,
        deps: DepsLayer | None,
        nodes: Sequence[str] | None = None,
        *,
        policy: SandboxPolicy | None = None,
    ) -> dict[str, int | str]:
        """Build the task's image (and ``deps``) on every trial node, or on those named
        (by id prefix or address), through each node's package cache when it is on
        (``package_cache``, or ``policy``'s); returns images built per node, or the error."""
        node_policy, package_cache = self._for_nodes(policy)
        if not self._connected:
            await anyio.to_thread.run_sync(self.connect)
        task_blob = await self._task_blob(task, task.root)
        deps_blob = await self._deps_blob(deps, None)
        targets = [
            n
            for n in self.live_nodes()
            if nodes is None or any(n.node_id.startswith(w) or n.address == w for w in nodes)
        ]

        async def one(node: _Node) -> int | str:
            try:
                out = await node.actor.prewarm.remote(
                    task, task_blob, deps, deps_blob, node_policy, package_cache
                )
                assert isinstance(out, NodePrewarm)
            except Exception as exc:
                return f"node {node.short}: {type(exc).__name__}: {exc}"
            node.images.update(out.images)
            _count_node_cache(out.package_cache)
            return out.built

        results = await asyncio.gather(*(one(n) for n in targets))
        return {n.short: r for n, r in zip(targets, results, strict=True)}

    async def aclose(self) -> None:
        await self._stop_trials()
        if not self._connected:
            return
        import ray

        refs = [(n, n.actor.close.remote()) for n in self.live_nodes()]
        for node, ref in refs:
            try:
                await asyncio.wait_for(ref, timeout=CALL_TIMEOUT_SEC)
            except Exception:
                logger.warning("Ray node %s did not close cleanly", node.short)
        for node in self.live_nodes():
            with contextlib.suppress(Exception):
                ray.kill(node.actor)

    def shutdown(self) -> None:
        """Leave the cluster (after ``aclose``)."""
        if self._connected:
            import ray

            ray.shutdown()
            self._connected = False


def _count_node_cache(report: NodeCacheReport | None) -> None:
    """A node's cache totals into this process's ``/metrics`` (labelled by node)."""
    if report is None:
        return
    from harbor_exec.network.packages.cache import NODE_CACHE_TOTALS

    NODE_CACHE_TOTALS.report(report)


def wait_for_nodes(executor: RayExecutor, count: int, timeout_sec: float = 60.0) -> None:
    """Block until ``count`` trial nodes are known (tests, scripts)."""
    executor.connect()
    deadline = time.monotonic() + timeout_sec
    while len(executor.live_nodes()) < count:
        if time.monotonic() > deadline:
            raise RayUnavailableError(f"fewer than {count} trial nodes after {timeout_sec:g}s")
        time.sleep(0.5)
        executor._refresh_sync()


def json_report(report: dict[str, int | str]) -> str:
    return json.dumps(report, sort_keys=True)


__all__ = [
    "NAMESPACE",
    "TRIAL_RESOURCE",
    "RayExecutor",
    "json_report",
    "wait_for_nodes",
]
