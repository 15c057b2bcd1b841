"""The server's package cache as a service: one ``PackageCache`` on an event loop
thread of its own, shared by every trial's egress proxy (each on its own loop).

``PackageCacheService.upstream(trial)`` is what a trial hands its ``EgressProxy`` as
``upstream``; requests cross from the proxy's loop to the cache's and bodies stream
back chunk by chunk (``_bridge``), so single downloads, locks and the upstream client
live on one loop.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

from harbor_exec.network.packages.build_gateway import BuildGateway, BuildRoute
from harbor_exec.network.packages.build_trust import trust_context_files
from harbor_exec.network.packages.ca import LocalCA
from harbor_exec.network.packages.cache import (
    CacheRequest,
    CacheResponse,
    CacheSession,
    CacheStats,
    HttpxUpstream,
    PackageCache,
    Resolver,
)
from harbor_exec.network.packages.config import (
    CA_DIR,
    DEFAULT_MAX_BYTES,
    STORE_DIR,
    STORE_SLOTS,
    TRUST_DIR,
    PackageCacheConfig,
    default_max_bytes,
)
from harbor_exec.network.packages.hosts import TlsHosts
from harbor_exec.network.packages.serve import CacheUpstream
from harbor_exec.network.packages.trust import system_trust_target, write_trust_dir
from harbor_exec.sandbox.runtime import ContainerRuntime

__all__ = [
    "DEFAULT_MAX_BYTES",
    "PackageCacheConfig",
    "PackageCacheService",
    "StoreSlot",
    "TrialCache",
    "default_max_bytes",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)


class StoreSlot:
    """This process's own store below the cache root, held (``flock``) for its life:
    ``package-cache`` when no other process holds it, else the first free
    ``package-cache-N``; a store is never opened by two processes at once (each keeps
    its index in memory). With every slot held, a temporary store that goes with it."""

    def __init__(self, config: PackageCacheConfig) -> None:
        self._lock: int | None = None
        self._temporary: Path | None = None
        for index in range(1, STORE_SLOTS + 1):
            name = STORE_DIR if index == 1 else f"{STORE_DIR}-{index}"
            path = config.directory(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path.parent / f".{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._lock, self.path = fd, path
            if index > 1:
                logger.info(
                    "package cache: %s is in use by another process; using %s",
                    config.directory(STORE_DIR),
                    path,
                )
            return
        self._temporary = self.path = Path(tempfile.mkdtemp(prefix="harbor-exec-package-cache-"))
        logger.warning(
            "package cache: all %d stores below %s are in use by other processes; this "
            "one uses a temporary store (%s), removed when it ends",
            STORE_SLOTS,
            config.directory(STORE_DIR).parent,
            self.path,
        )

    def release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="package-cache", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this loop, awaited from another."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def _next(iterator: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None


async def _bridge(
    iterator: AsyncIterator[bytes], loop: asyncio.AbstractEventLoop
) -> AsyncIterator[bytes]:
    """``iterator`` (driven on ``loop``) consumed from the running loop."""
    while True:
        chunk = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_next(iterator), loop))
        if chunk is None:
            return
        yield chunk


class TrialCache:
    """One trial's session, usable from the trial's proxy loop (``CacheUpstream``'s
    session)."""

    def __init__(self, service: PackageCacheService, session: CacheSession) -> None:
        self._service = service
        self._session = session

    @property
    def stats(self) -> CacheStats:
        return self._session.stats

    async def handle(self, request: CacheRequest) -> CacheResponse:
        caller = asyncio.get_running_loop()
        if request.body is not None:
            request.body = _bridge(request.body, caller)
        if request.resolve is not None:
            resolve = request.resolve

            async def resolve_there(host: str, port: int) -> tuple[str, int]:
                # The connector's lookups run on the proxy's own loop.
                future = asyncio.run_coroutine_threadsafe(_await(resolve(host, port)), caller)
                return await asyncio.wrap_future(future)

            request.resolve = resolve_there
        loop = self._service.thread.loop
        answer = await self._service.thread.call(self._session.handle(request))
        body = answer.body

        async def aclose() -> None:
            close = getattr(body, "aclose", None)
            if close is not None:
                await self._service.thread.call(close())

        bridged = _bridge(body, loop)
        return _Bridged(
            answer.status, answer.reason, answer.headers, bridged, answer.source, aclose
        )

    def begin(self, resolve: Resolver) -> None:
        """The trial starts now: indexes the upstream sends or confirms from now on
        serve it without asking again, and what its task's earlier trials asked for is
        revalidated at once (``PackageCache.revalidate_ahead``, through ``resolve``: the
        trial's own egress connector)."""
        session, cache = self._session, self._service.cache

        async def begin() -> None:
            session.since = time.time()
            cache.start(cache.revalidate_ahead(session, resolve))

        self._service.thread.run(begin())

    def finish(self) -> None:
        """The trial is over: what it asked is remembered for its task's next trials."""
        self._service.thread.run(_call(self._session.finish))

    def write(self, path: Path) -> None:
        self._session.write(path)


async def _call(function: Callable[[], None]) -> None:
    function()


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable


class _Bridged(CacheResponse):
    def __init__(
        self,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        body: AsyncIterator[bytes],
        source: str,
        close: Any,
    ) -> None:
        super().__init__(status, reason, headers, body, source)
        self._close = close

    async def aclose(self) -> None:
        await self._close()


class PackageCacheService:
    """The server's cache, CA and trust directory; start once, share across trials."""

    def __init__(self, config: PackageCacheConfig) -> None:
        self.config = config
        self.ca = LocalCA(config.directory(CA_DIR))
        self.trust_dir = write_trust_dir(self.ca, config.directory(TRUST_DIR))
        #: Where containers get the CA in their system store (its hash, computed once).
        self.system_trust_target = system_trust_target(self.ca)
        self.tls_hosts = TlsHosts(config.tls_hosts)
        self.slot = StoreSlot(config)
        self.max_bytes = config.bound()
        self.thread = _LoopThread()
        max_object = config.max_object_bytes or max(self.max_bytes // 4, 1)

        async def make() -> PackageCache:
            return PackageCache(
                self.slot.path,
                max_bytes=self.max_bytes,
                max_object_bytes=max_object,
                upstream=HttpxUpstream(ca_bundle=config.upstream_ca_bundle),
                index_fresh_sec=config.index_fresh_sec,
            )

        self.cache = self.thread.run(make())
        self._gateway: BuildGateway | None = None
        self._gateway_lock = threading.Lock()
        #: What image builds got through the cache (one session for every build).
        self.build_session: TrialCache | None = None

    def build_route(
        self,
        runtime: ContainerRuntime,
        *,
        overrides: Mapping[str, tuple[str, int]] | None = None,
        dns: bool = True,
    ) -> BuildRoute:
        """The build arguments and RUN network that send a build through the cache; the
        build gateway (``build_gateway``) starts with the first call and stays until
        ``close``. ``overrides``/``dns``: the operator's egress settings (the first
        call's are kept)."""
        with self._gateway_lock:
            if self._gateway is not None and not self._gateway.running():
                # The engine restarted (or someone removed it): a new one.
                self._gateway.close()
                self._gateway = None
            if self._gateway is None:
                if self.build_session is None:
                    self.build_session = self.session()
                # HTTPS terminated as a trial's: the builds trust the CA for their steps
                # (build_trust: the public trust files in the context, ARGs, no ENV).
                upstream = CacheUpstream(self.build_session, self.ca, tls_hosts=self.tls_hosts)
                self._gateway = BuildGateway(
                    runtime,
                    upstream,
                    overrides=overrides,
                    dns=dns,
                    trust_files=trust_context_files(self.trust_dir),
                )
            return self._gateway.route

    def session(self) -> TrialCache:
        """A session that revalidates every index request (the builds')."""
        return TrialCache(self, self.cache.session())

    def trial_session(self, task: str) -> TrialCache:
        """A trial's session, remembered under ``task``; ``TrialCache.begin`` when the
        trial starts."""
        return TrialCache(self, self.cache.session(task=task))

    def upstream(self, session: TrialCache) -> CacheUpstream:
        """The ``Upstream`` a trial's egress proxy hands admitted traffic to."""
        return CacheUpstream(session, self.ca, tls_hosts=self.tls_hosts)

    def close(self) -> None:
        with self._gateway_lock:
            gateway, self._gateway = self._gateway, None
        try:
            if gateway is not None:
                gateway.close()
            self.thread.run(self.cache.aclose())
        finally:
            self.thread.stop()
            self.slot.release()
