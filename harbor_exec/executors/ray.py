"""Trials on the nodes of a Ray cluster (the optional extra ``harbor-exec[ray]``).

``RayExecutor`` is a ``TrialExecutor``: the server stays the single control plane
(admission, queue, status, cancel); each trial runs on a Ray node with a Docker engine.

* **Nodes.** A node offers trial slots through the custom resource
  ``harbor_exec_trial`` (``ray start --resources '{"harbor_exec_trial": 16}'``). For
  each such node the executor starts one long-lived actor (``NodeAgent``) pinned to it;
  the actor wraps a ``LocalExecutor``, so it owns that node's Docker runtime, its
  image cache, its reaper and the model relays of its trials. The node table is
  re-read every second, so a node that joins takes trials without a restart.
* **Placement.** The server counts slots itself (the resource's amount on each
  node) and calls the node's actor directly: one Ray task per trial would cost a
  worker process per running trial. A trial prefers a node that already has its
  image (soft affinity), else the least loaded node with a free slot.
* **No shared filesystem.** Task snapshots (content-hashed) and the bundle (its
  wheelhouse, and its files) go through Ray's object store once, as references; a
  node materializes each under its cache directory by hash, once, and rewrites the
  request's paths. The trial directory (``result.json``, kept logs, artifacts, the
  sample; bounded by the sandbox policy) comes back as one archive, written under
  the server's trials directory with ``config.node`` naming the node.
* **Secrets.** Everything per-rollout that may hold a secret (the ``ModelEndpoint``
  with the trainer's key, the scrub list, the agent's input, the verifier's input)
  is sealed for the target actor: each actor makes an X25519 key pair in memory at
  start and publishes only the public key; the server seals each call with a fresh
  ephemeral key (X25519 → HKDF-SHA256 → AES-256-GCM, i.e. ECIES). What Ray stores,
  logs, spills or shows is ciphertext; only that actor's process can open it.
* **Faults.** A node that dies fails its trials with ``RayNodeLostError``
  (``internal_error``, "Ray node N was lost during the agent phase"), once; its
  containers belong to a dead process and are reaped by any node's reaper sharing
  its engine, or by its own when it returns. ``available()`` explains why no trial
  can start (cluster unreachable, no node with slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import pickle
import secrets as secrets_module
import shutil
import socket
import tarfile
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.to_thread

from harbor_exec.errors import HarborExecError
from harbor_exec.executors.local import (
    ExecutorHealth,
    LocalExecutor,
    ModelEndpoint,
    ModelUsage,
    PhaseCallback,
    TaskExecutor,
    TaskTrialHandle,
    TrialHandle,
    TrialRun,
)
from harbor_exec.sandbox.deps import DepsLayer
from harbor_exec.trial.agents import TestsVerifier, WorkflowAgent
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.task import Task
from harbor_exec.trial.trial import TrialRequest, image_tag_for, new_trial_name

logger = logging.getLogger(__name__)

TRIAL_RESOURCE = "harbor_exec_trial"
NAMESPACE = "harbor-exec"
#: The most a trial directory may weigh on its way back (its parts are bounded by
#: ``SandboxPolicy.output``; this bounds their sum).
MAX_RESULT_BYTES = 256 * 1024 * 1024
REFRESH_SEC = 1.0
CALL_TIMEOUT_SEC = 30.0
#: The node table read is the server's heartbeat to the cluster: unanswered this
#: long, the cluster counts as unreachable (admissions get 503) until it answers.
UNREACHABLE_AFTER_SEC = 5.0
#: How long the server's Ray driver keeps retrying a GCS that went away before Ray
#: ends the process (Ray's default is 60 s); the server must outlive an outage.
GCS_RECONNECT_SEC = 7 * 24 * 3600
#: Names a node for its containers' owner labels (default: the host name); a node
#: that returns under the same name reaps what its previous incarnation left.
NODE_NAME_ENV = "HARBOR_EXEC_NODE_NAME"


class RayUnavailableError(HarborExecError):
    """The Ray cluster cannot be reached (or has no node offering trial slots)."""


class RayNodeLostError(HarborExecError):
    """The Ray node running a trial died or left the cluster."""


# --------------------------------------------------------------------------- sealing


def _crypto() -> Any:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import (
        X25519PrivateKey,
        X25519PublicKey,
    )
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return hashes, serialization, X25519PrivateKey, X25519PublicKey, AESGCM, HKDF


_INFO = b"harbor-exec ray seal v1"


def _derive(shared: bytes, ephemeral_public: bytes, recipient_public: bytes) -> bytes:
    hashes, _ser, _priv, _pub, _aes, hkdf = _crypto()
    return bytes(
        hkdf(
            algorithm=hashes.SHA256(),
            length=32,
            salt=ephemeral_public + recipient_public,
            info=_INFO,
        ).derive(shared)
    )


def _raw_public(key: Any) -> bytes:
    _h, serialization, _priv, _pub, _aes, _hkdf = _crypto()
    return bytes(
        key.public_bytes(encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw)
    )


def seal(recipient_public: bytes, payload: bytes) -> bytes:
    """Encrypt ``payload`` for the holder of ``recipient_public`` (X25519 ECIES)."""
    _h, _ser, private_cls, public_cls, aesgcm, _hkdf = _crypto()
    ephemeral = private_cls.generate()
    ephemeral_public = _raw_public(ephemeral.public_key())
    shared = ephemeral.exchange(public_cls.from_public_bytes(recipient_public))
    key = _derive(shared, ephemeral_public, recipient_public)
    nonce = os.urandom(12)
    return ephemeral_public + nonce + bytes(aesgcm(key).encrypt(nonce, payload, _INFO))


class Opener:
    """An X25519 key pair held in memory; ``open`` reverses ``seal``."""

    def __init__(self) -> None:
        _h, _ser, private_cls, _pub, _aes, _hkdf = _crypto()
        self._private = private_cls.generate()
        self.public = _raw_public(self._private.public_key())

    def open(self, sealed: bytes) -> bytes:
        _h, _ser, _priv, public_cls, aesgcm, _hkdf = _crypto()
        ephemeral_public, nonce, body = sealed[:32], sealed[32:44], sealed[44:]
        shared = self._private.exchange(public_cls.from_public_bytes(ephemeral_public))
        key = _derive(shared, ephemeral_public, self.public)
        return bytes(aesgcm(key).decrypt(nonce, body, _INFO))


# --------------------------------------------------------------------------- archives


def tar_dir(root: Path, *, limit: int | None = None) -> bytes:
    """``root`` as an uncompressed tar (regular files and dirs; no links), in memory."""
    buffer = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(root.rglob("*")):
            if path.is_symlink():
                continue
            rel = path.relative_to(root).as_posix()
            if path.is_dir():
                tar.add(path, arcname=rel, recursive=False)
            elif path.is_file():
                size = path.stat().st_size
                if limit is not None and total + size > limit:
                    continue  # over the bound: dropped (each part is bounded already)
                total += size
                tar.add(path, arcname=rel, recursive=False)
    return buffer.getvalue()


def untar(data: bytes, target: Path) -> None:
    """Extract ``data`` (from ``tar_dir``) into ``target``, refusing anything unsafe."""
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(target, filter="data")


def _materialize(root: Path, key: str, data: bytes) -> Path:
    """``root/key`` holding ``data``'s files, written once (atomically) per node."""
    final = root / key
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=root))
    untar(data, scratch)
    try:
        scratch.rename(final)
    except OSError:  # another trial won the race: same content
        shutil.rmtree(scratch, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- node actor


@dataclass
class _Call:
    """One trial as it travels to a node: plain, non-secret fields, references to
    content-hashed blobs, and the sealed per-rollout part."""

    request: TrialRequest  # task.files/deps/agent/verifier/secrets rewritten or cleared
    task_key: str
    task_blob: list[Any]  # [ObjectRef]: a nested reference is fetched only on a cache miss
    deps_key: str | None
    deps_blob: list[Any]
    bundle_key: str | None
    bundle_blob: list[Any]
    sealed: bytes  # pickle({"model", "secrets", "agent", "verifier"}) sealed for the node


class NodeAgent:
    """The long-lived actor on one node: its Docker runtime, image cache, reaper and
    relays (a ``LocalExecutor``), and its cache of task snapshots and bundles."""

    def __init__(self, cache_dir: str, reap_interval_sec: float = 5.0) -> None:
        import ray

        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.cache = Path(cache_dir) / self.node_id[:16]
        self.cache.mkdir(parents=True, exist_ok=True)
        self._opener = Opener()
        from harbor_exec.sandbox.docker import DockerRuntime, current_owner

        # Owner labels name the node, so only this node's actors (this one, or a
        # later one once the node returns) reap what a dead actor here left; other
        # nodes sharing an engine leave those containers alone.
        self.name = (os.environ.get(NODE_NAME_ENV) or socket.gethostname()).replace("/", "_")
        runtime = DockerRuntime(owner=current_owner(f"ray-node:{self.name}"))
        with contextlib.suppress(Exception):
            runtime.reap_orphans()
        self.local = LocalExecutor(runtime, reap_interval_sec=reap_interval_sec)
        self._handles: dict[str, TrialHandle] = {}
        self._cancelled: set[str] = set()
        self._bundles: dict[str, list[Any]] = {}

    def public_key(self) -> bytes:
        return self._opener.public

    async def info(self) -> dict[str, Any]:
        runtime = self.local.runtime
        pid_max, cpus = await anyio.to_thread.run_sync(
            lambda: (runtime.pid_max(), runtime.engine_cpus())
        )
        return {
            "node_id": self.node_id,
            "name": self.name,
            "hostname": socket.gethostname(),
            "pid_max": pid_max,
            "cpus": cpus,
            "images": await self._images(),
        }

    async def _images(self) -> list[str]:
        runtime = self.local.runtime
        infos = await anyio.to_thread.run_sync(runtime.list_images)
        return sorted({tag for info in infos for tag in _tags(info)})

    async def health(self) -> dict[str, Any]:
        health = await anyio.to_thread.run_sync(self.local.health)
        return {"available": health.available, "reason": health.reason, "images": health.images}

    async def _unpacked(self, kind: str, key: str, blob: list[Any]) -> Path:
        """The tree of ``blob`` under ``<cache>/<kind>/<key>``, unpacked on first use."""
        root = self.cache / kind / key
        if not root.is_dir():
            data = await blob[0]
            root = await anyio.to_thread.run_sync(_materialize, self.cache / kind, key, data)
        return root

    async def _task(self, key: str, blob: list[Any], task: Task) -> Task:
        return replace(task, files=await self._unpacked("tasks", key, blob))

    async def _deps(self, key: str, blob: list[Any], deps: DepsLayer) -> DepsLayer:
        return replace(deps, wheelhouse=await self._unpacked("deps", key, blob))

    async def _bundle(self, key: str, blob: list[Any]) -> list[Any]:
        if key not in self._bundles:
            self._bundles[key] = pickle.loads(await blob[0])
        return self._bundles[key]

    async def _prepare(self, call: _Call) -> tuple[TrialRequest, ModelEndpoint | None]:
        request = call.request
        original_root = request.task.root
        task = await self._task(call.task_key, call.task_blob, request.task)
        secret: dict[str, Any] = pickle.loads(self._opener.open(call.sealed))
        agent = secret["agent"]
        if call.bundle_key is not None and isinstance(agent, WorkflowAgent):
            agent._files = await self._bundle(call.bundle_key, call.bundle_blob)
        verifier = secret["verifier"]
        if isinstance(verifier, TestsVerifier) and verifier.tests_dir is not None:
            with contextlib.suppress(ValueError):
                rel = verifier.tests_dir.relative_to(original_root)
                verifier = replace(verifier, tests_dir=task.root / rel)
        deps = request.deps
        if deps is not None and call.deps_key is not None:
            deps = await self._deps(call.deps_key, call.deps_blob, deps)
        trials_dir = self.cache / "trials" / secrets_module.token_hex(6)
        request = replace(
            request,
            task=task,
            trials_dir=trials_dir,
            agent=agent,
            verifier=verifier,
            secrets=list(secret["secrets"]),
            deps=deps,
        )
        return request, secret["model"]

    async def run(self, call: _Call) -> AsyncIterator[Any]:
        """Run one trial; yields ``("phase", name)`` as it goes, then ``("done", dict)``."""
        name = call.request.trial_name or ""
        started = time.perf_counter()
        request, model = await self._prepare(call)
        prepared = time.perf_counter()
        phases: asyncio.Queue[str] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_phase(phase: str) -> None:
            loop.call_soon_threadsafe(phases.put_nowait, phase)

        handle = self.local.submit(request, model=model, on_phase=on_phase)
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
                    yield ("phase", getter.result())
                    continue
                getter.cancel()
                while not phases.empty():
                    yield ("phase", phases.get_nowait())
                break
            run = result_task.result()
        finally:
            self._handles.pop(name, None)
            self._cancelled.discard(name)
        ran = time.perf_counter()

        def pack() -> bytes:
            data = tar_dir(run.trial_dir, limit=MAX_RESULT_BYTES)
            shutil.rmtree(request.trials_dir, ignore_errors=True)
            return data

        data = await anyio.to_thread.run_sync(pack)
        usage = run.usage
        # The image list (a Docker call) only changes when the trial built an image.
        images = await self._images() if run.images_built else None
        yield (
            "done",
            {
                "archive": data,
                "images_built": run.images_built,
                "usage": None if usage is None else usage.__dict__,
                "images": images,
                "timings": {
                    "node_prepare": prepared - started,
                    "node_trial": ran - prepared,
                    "node_pack": time.perf_counter() - ran,
                },
            },
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
        task_key: str,
        task_blob: list[Any],
        deps: DepsLayer | None,
        deps_key: str | None,
        deps_blob: list[Any],
    ) -> dict[str, Any]:
        local_task = await self._task(task_key, task_blob, task)
        if deps is not None and deps_key is not None:
            deps = await self._deps(deps_key, deps_blob, deps)
        built = await self.local.prewarm(local_task, deps)
        return {"built": built, "images": await self._images()}

    async def close(self) -> int:
        await self.local.aclose()
        return 0


def _tags(info: Any) -> list[str]:
    tags = getattr(info, "tags", None)
    if tags:
        return [str(t) for t in tags]
    tag = getattr(info, "tag", None)
    return [str(tag)] if tag else []


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

    @property
    def short(self) -> str:
        return self.node_id[:12]


class _RayHandle(TaskTrialHandle):
    def __init__(self, request: TrialRequest, on_phase: PhaseCallback | None) -> None:
        super().__init__(request, on_phase)
        self.node: _Node | None = None
        self.phase: str | None = None
        self.cancelled = False


class RayExecutor(TaskExecutor[_RayHandle]):
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
    ) -> None:
        super().__init__()
        self.address = address
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
        self._bundle_keys: dict[int, tuple[Any, str]] = {}
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
                name=str(info.get("name", "")),
                pid_max=int(info["pid_max"]),
                cpus=int(info["cpus"]),
                images=set(info["images"]),
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

    def live_nodes(self) -> list[_Node]:
        with self._lock:
            return [n for n in self._nodes.values() if n.alive]

    # ----------------------------------------------------------------- blobs

    async def _blob(self, key: str, make: Any) -> Any:
        ref = self._blobs.get(key)
        if ref is None:
            import ray

            data = await anyio.to_thread.run_sync(make)
            ref = self._blobs.setdefault(key, ray.put(data))
        return ref

    async def _task_blob(self, task: Task) -> tuple[str, Any]:
        key = "t-" + _digest(task.root.name, *task.digests, task.name)
        return key, await self._blob(key, lambda: tar_dir(task.root))

    async def _deps_blob(self, deps: DepsLayer | None) -> tuple[str | None, list[Any]]:
        if deps is None:
            return None, []
        key = "d-" + _digest(deps.requirements_digest, str(deps.wheelhouse))
        return key, [await self._blob(key, lambda: tar_dir(deps.wheelhouse))]

    def _bundle_key(self, files: list[Any]) -> str:
        known = self._bundle_keys.get(id(files))
        if known is not None and known[0] is files:
            return known[1]
        key = "b-" + _digest(pickle.dumps(files).hex())
        self._bundle_keys[id(files)] = (files, key)
        return key

    # ----------------------------------------------------------------- trials

    def _new_handle(self, request: TrialRequest, on_phase: PhaseCallback | None) -> _RayHandle:
        if request.trial_name is None:  # the node agent cancels trials by name
            request = replace(request, trial_name=new_trial_name(request.task.name))
        return _RayHandle(request, on_phase)

    def _image_key(self, task: Task) -> str:
        env = task.config.environment
        return image_tag_for(task) if task.dockerfile is not None else str(env.docker_image)

    async def _acquire(self, handle: _RayHandle) -> _Node:
        image = handle.request.image or self._image_key(handle.request.task)
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

    async def _run(self, handle: _RayHandle, model: ModelEndpoint | None) -> TrialRun:
        import ray

        if not self._connected:
            await anyio.to_thread.run_sync(self.connect)
        request = handle.request
        setup = time.perf_counter()
        task_key, task_ref = await self._task_blob(request.task)
        deps_key, deps_blob = await self._deps_blob(request.deps)
        agent = request.agent
        bundle_key: str | None = None
        bundle_blob: list[Any] = []
        if isinstance(agent, WorkflowAgent):
            files = agent._files
            bundle_key = self._bundle_key(files)
            bundle_blob = [await self._blob(bundle_key, lambda: pickle.dumps(files))]
            agent = WorkflowAgent.__new__(WorkflowAgent)
            agent.__dict__.update(request.agent.__dict__)
            agent._files = []
        secret = pickle.dumps(
            {
                "model": model,
                "secrets": list(request.secrets),
                "agent": agent,
                "verifier": request.verifier,
            }
        )
        plain = replace(request, secrets=(), verifier=None)
        plain.agent = _Placeholder()  # type: ignore[assignment]
        node = await self._acquire(handle)
        handle.node = node
        node.trials += 1
        placed = time.perf_counter()
        try:
            call = _Call(
                request=plain,
                task_key=task_key,
                task_blob=[task_ref],
                deps_key=deps_key,
                deps_blob=deps_blob,
                bundle_key=bundle_key,
                bundle_blob=bundle_blob,
                sealed=seal(node.public_key, secret),
            )
            done: dict[str, Any] | None = None
            try:
                stream = node.actor.run.options(num_returns="streaming").remote(call)
                if handle.cancelled:
                    node.actor.cancel.remote(handle.name)
                async for ref in stream:
                    kind, value = await ref
                    if kind == "phase":
                        handle.phase = value
                        if handle.on_phase is not None:
                            handle.on_phase(value)
                    else:
                        done = value
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
        if done["images"] is not None:
            node.images.update(done["images"])
        elif (image := request.image or self._image_key(request.task)) is not None:
            node.images.add(image)  # it ran there, so the node has it now
        trial_dir = request.trials_dir / handle.name
        back = time.perf_counter()
        result = await anyio.to_thread.run_sync(
            lambda: self._write_back(trial_dir, done["archive"], node)
        )
        timings = dict(done.get("timings") or {})
        timings["server_setup_and_place"] = placed - setup
        timings["server_remote"] = back - placed
        timings["server_write_back"] = time.perf_counter() - back
        # What the remote call cost beyond the node's own work: Ray's share.
        timings["ray_transport"] = timings["server_remote"] - sum(
            v for k, v in timings.items() if k.startswith("node_")
        )
        self._record(timings)
        usage = done.get("usage")
        return TrialRun(
            result,
            trial_dir,
            int(done["images_built"]),
            node=node.node_id,
            usage=ModelUsage(**usage) if usage else None,
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

    def _write_back(self, trial_dir: Path, archive: bytes, node: _Node) -> TrialResult:
        untar(archive, trial_dir)
        path = trial_dir / "result.json"
        result = TrialResult.model_validate_json(path.read_text(encoding="utf-8"))
        result.trial_uri = trial_dir.resolve().as_uri()
        result.config = {
            **result.config,
            "trials_dir": str(trial_dir.parent),
            "node": {"ray_node_id": node.node_id, "address": node.address},
        }
        result.write(trial_dir)
        return result

    def cancel(self, handle: TrialHandle) -> None:
        assert isinstance(handle, _RayHandle)
        handle.cancelled = True
        if handle.node is not None and handle.node.alive:
            handle.node.actor.cancel.remote(handle.name)
        self._slot_freed.set()

    # ----------------------------------------------------------------- health

    def nodes(self) -> list[dict[str, Any]]:
        with self._lock:
            known = list(self._nodes.values())
        return [
            {
                "node": n.short,
                "node_id": n.node_id,
                "name": n.name,
                "address": n.address,
                "alive": n.alive,
                "slots": n.slots,
                "in_use": n.in_use,
                "trials": n.trials,
                "images": len(n.images),
            }
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

    async def prewarm(self, task: Task, deps: DepsLayer | None) -> int:
        report = await self.prewarm_nodes(task, deps)
        errors = [v for v in report.values() if isinstance(v, str)]
        if errors:
            raise HarborExecError("; ".join(errors))
        return sum(v for v in report.values() if isinstance(v, int))

    async def prewarm_nodes(
        self, task: Task, deps: DepsLayer | None, nodes: Sequence[str] | None = None
    ) -> dict[str, int | str]:
        """Build the task's image (and ``deps``) on every trial node, or on those named
        (by id prefix or address); returns images built per node, or the error."""
        if not self._connected:
            await anyio.to_thread.run_sync(self.connect)
        task_key, task_ref = await self._task_blob(task)
        deps_key, deps_blob = await self._deps_blob(deps)
        targets = [
            n
            for n in self.live_nodes()
            if nodes is None or any(n.node_id.startswith(w) or n.address == w for w in nodes)
        ]

        async def one(node: _Node) -> int | str:
            try:
                out = await node.actor.prewarm.remote(
                    task, task_key, [task_ref], deps, deps_key, deps_blob
                )
            except Exception as exc:
                return f"node {node.short}: {type(exc).__name__}: {exc}"
            node.images.update(out["images"])
            return int(out["built"])

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


class _Placeholder:
    """Stands in for the sealed agent in the plain part of a call."""

    info: Any = None


def _digest(*parts: str) -> str:
    import hashlib

    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


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
    "TRIAL_RESOURCE",
    "NodeAgent",
    "RayExecutor",
    "RayNodeLostError",
    "RayUnavailableError",
    "seal",
]
