"""The package cache: a bounded, host-side store of what trial containers and builds
download (apt, PyPI, npm, release files), filled only from the upstream.

What is stored, and how a request is answered (docs/package-cache.md):

* Only a ``GET`` without credentials (no ``Authorization``, no ``Cookie``) is
  cacheable. Its upstream request is built by the cache from the URL alone (plus
  the client's ``Accept``, which is part of the key, because PyPI's simple pages
  vary on it): no other client header reaches the upstream, so a client cannot
  change what is stored for a URL, and one rollout cannot poison another.
* A response is stored only when it is a ``200`` with a ``Content-Length`` (or a
  body that ends) within the object bound, without ``Cache-Control: no-store`` or
  ``private``, without ``Set-Cookie`` and without a ``Vary`` beyond ``Accept`` and
  ``Accept-Encoding`` (the cache always asks for ``identity``).
* **Indexes** (apt ``dists/``, PyPI ``/simple/`` and JSON API, npm package
  documents) are revalidated (``If-None-Match`` / ``If-Modified-Since``) so that a
  trial sees a new upstream release: a trial's session (``since``) is answered only
  with a copy the upstream sent or confirmed after the trial began, revalidating on
  request otherwise (a session without ``since``, such as the builds', on every
  request; with ``index_fresh_sec``, within that window). An index without
  validators is not stored.
* **Ahead of a trial** (``revalidate_ahead``), what the task's earlier trials asked
  for that needs revalidating is revalidated at once, concurrently, when the trial
  begins, so its requests find copies already confirmed for it instead of waiting
  one round trip each; only stored entries are asked for, nothing new is fetched.
* **Artifacts** (``.deb``, wheels, sdists, tarballs, apt ``pool/`` and ``by-hash/``,
  ``files.pythonhosted.org/packages/``, npm ``/-/`` tarballs) are named by content
  and served from the cache without asking the upstream.
* **Other** files (installer scripts, release binaries) follow their freshness
  (``max-age``/``Expires``); when stale they are revalidated, and without
  validators or freshness they are not stored.
* Everything else (other methods, credentials, non-200 answers) passes through
  unchanged and is never stored.

The store is a directory of body files and JSON metadata, bounded in bytes with
least-recently-used eviction. Concurrent requests for one URL share one upstream
download (the first starts it; everyone tails the file as it grows), so twenty
builds fetch a shared package once. The download runs on its own, so a slow or
stalled client delays nobody else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import hashlib
import json
import logging
import os
import re
import secrets
import ssl
import time
from collections import OrderedDict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Mapping,
    Sequence,
)
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, Protocol

import httpx
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from harbor_exec.network.egress.proxy import Connector, EgressRefused
from harbor_exec.network.http11 import HOP_BY_HOP, READ_SIZE

__all__ = [
    "CACHE_METRICS",
    "NODE_CACHE_TOTALS",
    "SERVER_NODE",
    "Answering",
    "CacheMetrics",
    "CacheRequest",
    "CacheResponse",
    "CacheSession",
    "CacheStats",
    "CacheTotals",
    "HttpxUpstream",
    "Kind",
    "NodeCacheReport",
    "NodeCacheTotals",
    "PackageCache",
    "RecallStore",
    "Resolver",
    "classify",
    "connector_resolver",
]

logger = logging.getLogger(__name__)

Headers = list[tuple[str, str]]
# host, port -> the address to connect to: the trial's egress ``Connector`` (the
# operator's overrides, else DNS with non-public addresses refused).
Resolver = Callable[[str, int], Awaitable[tuple[str, int]]]


def connector_resolver(connector: Connector) -> Resolver:
    """The first address ``connector`` allows (EgressRefused when none)."""

    async def resolve(host: str, port: int) -> tuple[str, int]:
        addresses = await connector.resolve(host, port)
        return addresses[0]

    return resolve


_CHUNK: Final = READ_SIZE
USER_AGENT: Final = "harbor-exec-package-cache/1"
# Hop-by-hop and proxy headers: never forwarded in either direction (RFC 9110 7.6.1).
_HOP_BY_HOP: Final = frozenset(name.decode() for name in HOP_BY_HOP)
# Response headers kept with a stored body and sent back with it.
_STORED_HEADERS: Final = frozenset(
    {
        "content-type",
        "etag",
        "last-modified",
        "cache-control",
        "expires",
        "content-disposition",
        "x-pypi-last-serial",
    }
)
_VARY_OK: Final = frozenset({"accept", "accept-encoding"})


class Kind(StrEnum):
    INDEX = "index"
    ARTIFACT = "artifact"
    OTHER = "other"


_ARTIFACT_SUFFIXES: Final = (
    ".deb",
    ".udeb",
    ".whl",
    ".tar.gz",
    ".tgz",
    ".tar.bz2",
    ".tar.xz",
    ".tar.zst",
    ".zip",
    ".gem",
    ".jar",
    ".crate",
    ".dsc",
    ".diff.gz",
    ".metadata",  # PEP 658 metadata files beside wheels (same content URL)
)
_APT_INDEX: Final = re.compile(r"/dists/[^?]*$")
_PYPI_JSON: Final = re.compile(r"^/pypi/[^/]+(/[^/]+)?/json/?$")


def classify(host: str, path: str) -> Kind:
    """Which rule a URL (``host`` and ``path`` without the query) falls under."""
    host = host.lower()
    lower = path.lower()
    if "/by-hash/" in lower:  # apt's content-addressed indexes
        return Kind.ARTIFACT
    if _APT_INDEX.search(lower) or "/simple/" in lower or lower.endswith("/simple"):
        return Kind.INDEX
    if _PYPI_JSON.match(lower):
        return Kind.INDEX
    if "/-/" in lower and lower.endswith(".tgz"):  # npm tarballs
        return Kind.ARTIFACT
    if lower.endswith(_ARTIFACT_SUFFIXES) or "/pool/" in lower:
        return Kind.ARTIFACT
    if host.startswith("files.pythonhosted.org") and lower.startswith("/packages/"):
        return Kind.ARTIFACT
    if host.startswith("registry.npmjs.org") or host.startswith("registry.yarnpkg.com"):
        return Kind.INDEX  # package documents (tarballs matched above)
    return Kind.OTHER


# --------------------------------------------------------------------------- request / response


@dataclass
class CacheRequest:
    """One request as the proxy received it, with its absolute target."""

    method: str
    scheme: str  # "http" or "https"
    host: str
    port: int
    target: str  # path and query, starting with "/"
    headers: Headers = field(default_factory=list)
    body: AsyncIterator[bytes] | None = None
    # How to reach the upstream (the trial's egress connector); never part of the key.
    resolve: Resolver | None = None

    def header(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


@dataclass
class CacheResponse:
    """What to send back: status, headers (no hop-by-hop ones; ``Content-Length``
    when known) and the body, which the writer must drain or ``aclose``."""

    status: int
    reason: str
    headers: Headers
    body: AsyncIterator[bytes]
    source: str  # "hit", "revalidated", "miss", "pass"

    async def aclose(self) -> None:
        close = getattr(self.body, "aclose", None)
        if close is not None:
            await close()


# --------------------------------------------------------------------------- statistics


@dataclass
class CacheStats:
    """Hits, misses and bytes: one trial's (``package-cache.json``) or a server's."""

    requests: int = 0
    hits: int = 0
    revalidated: int = 0  # served from the cache after a 304 from the upstream
    misses: int = 0  # fetched from the upstream and stored
    passthrough: int = 0  # not cacheable: fetched and not stored
    upstream_requests: int = 0
    # Of upstream_requests: revalidations sent when the trial began (``revalidate_ahead``).
    revalidated_ahead: int = 0
    upstream_errors: int = 0
    bytes_from_cache: int = 0
    bytes_from_upstream: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def add(self, other: CacheStats) -> None:
        for key, value in asdict(other).items():
            setattr(self, key, getattr(self, key) + value)


@dataclass
class CacheTotals(CacheStats):
    """One cache's sums (all its sessions) and its store now (``PackageCache.totals``):
    what a Ray node reports to the server's ``/metrics``."""

    evictions: int = 0
    stored_bytes: int = 0
    stored_entries: int = 0
    bound_bytes: int = 0


@dataclass(frozen=True)
class NodeCacheReport:
    """One Ray node's cache totals as its actor saw them (host side, never a file a
    container wrote): ``seq`` orders one actor's reports, ``incarnation`` tells a
    restarted actor (which counts from zero again) from the one before."""

    node: str
    incarnation: str
    seq: int
    totals: CacheTotals


#: The ``node`` label of the server's own process (its cache, when it runs one).
SERVER_NODE: Final = "server"

#: ``CacheTotals``'s counters as ``harbor_exec_package_cache_<name>_total{node}``.
_COUNTERS: Final = (
    ("requests", "Requests the package cache answered."),
    ("hits", "Requests served from the cache without asking the upstream."),
    ("revalidated", "Requests served from the cache after the upstream confirmed it."),
    ("revalidated_ahead", "Revalidations sent when a trial began, before it asked."),
    ("misses", "Cacheable requests fetched from the upstream and stored."),
    ("passthrough", "Requests passed to the upstream, not cacheable."),
    ("upstream_requests", "Requests the cache sent upstream."),
    ("upstream_errors", "Upstream requests that failed."),
    ("evictions", "Entries evicted to stay within the bound."),
)
#: ``CacheTotals``'s gauges as ``harbor_exec_package_cache_<name>{node}``.
_GAUGES: Final = (
    ("stored_bytes", "Bytes stored now."),
    ("stored_entries", "Entries stored now."),
    ("bound_bytes", "The cache's bound."),
)
#: ``CacheTotals``'s body bytes as ``harbor_exec_package_cache_bytes_total{node,source}``.
_BYTES_SOURCE: Final = {"bytes_from_cache": "cache", "bytes_from_upstream": "upstream"}


class CacheMetrics:
    """``harbor_exec_package_cache_*`` by ``node`` as prometheus-client metrics, updated
    as things happen: the server's own caches count into node ``server`` as they answer
    (``PackageCache``), each Ray node's cache as its report arrives
    (``NodeCacheTotals``). ``CACHE_METRICS`` is the process's, in prometheus-client's
    default registry (every server's ``/metrics`` appends it); another instance keeps
    its own registry (a test's)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        own = self.registry
        prefix = "harbor_exec_package_cache_"
        self._metrics: dict[str, Counter | Gauge] = {}
        for name, help_text in _COUNTERS:
            self._metrics[name] = Counter(prefix + name, help_text, ["node"], registry=own)
        for name, help_text in _GAUGES:
            self._metrics[name] = Gauge(prefix + name, help_text, ["node"], registry=own)
        self._bytes = Counter(
            prefix + "bytes",
            "Body bytes sent to clients, by source.",
            ["node", "source"],
            registry=own,
        )
        # labels() validates and locks on every call; a child per key is kept instead.
        self._children: dict[tuple[str, str], Counter | Gauge] = {}
        self.touch(SERVER_NODE)  # the server's row is there (at 0) before it has a cache

    def _child(self, node: str, name: str) -> Counter | Gauge:
        child = self._children.get((node, name))
        if child is None:
            source = _BYTES_SOURCE.get(name)
            if source is not None:
                child = self._bytes.labels(node, source)
            else:
                child = self._metrics[name].labels(node)
            self._children[(node, name)] = child
        return child

    def touch(self, node: str) -> None:
        """Every series of ``node``, at 0 until counted."""
        for name in (*self._metrics, *_BYTES_SOURCE):
            self._child(node, name)

    def count(self, node: str, **deltas: int) -> None:
        """Add to ``node``'s counters (``CacheTotals``'s field names)."""
        for name, delta in deltas.items():
            if delta:
                self._child(node, name).inc(delta)

    def set(self, node: str, **values: int) -> None:
        """Set ``node``'s gauges (what is stored now, the bound)."""
        for name, value in values.items():
            child = self._child(node, name)
            assert isinstance(child, Gauge)
            child.set(value)

    def forget(self, node: str) -> None:
        """Drop ``node``'s series."""
        for known, name in [key for key in self._children if key[0] == node]:
            del self._children[(known, name)]
            source = _BYTES_SOURCE.get(name)
            if source is not None:
                self._bytes.remove(node, source)
            else:
                self._metrics[name].remove(node)

    def value(self, node: str, name: str) -> float:
        """``node``'s figure for ``name`` (a ``CacheTotals`` field) as exposed."""
        source = _BYTES_SOURCE.get(name)
        if source is not None:
            sample, labels = (
                "harbor_exec_package_cache_bytes_total",
                {"node": node, "source": source},
            )
        else:
            suffix = "" if name in dict(_GAUGES) else "_total"
            sample = f"harbor_exec_package_cache_{name}{suffix}"
            labels = {"node": node}
        return self.registry.get_sample_value(sample, labels) or 0.0


class NodeCacheTotals:
    """The latest report of every Ray node's cache, in the server's process, counted
    into ``metrics`` by node as each report arrives.

    Reports are cumulative, so keeping the latest (by ``seq``) of each actor makes a
    repeated, late or out-of-order report harmless: nothing is counted twice. A node's
    counters are summed over its actors' lifetimes; its gauges (what is stored now) are
    its current actor's, the one that reported first most recently: a restarted actor
    finds the same store, which must not count twice either."""

    def __init__(self, metrics: CacheMetrics) -> None:
        self.metrics = metrics
        self._latest: dict[tuple[str, str], NodeCacheReport] = {}
        self._current: dict[str, str] = {}  # node -> its newest actor's incarnation
        self._counted: dict[str, CacheTotals] = {}  # node -> what metrics has of it

    def report(self, report: NodeCacheReport) -> None:
        key = (report.node, report.incarnation)
        known = self._latest.get(key)
        if known is None:
            self._current[report.node] = report.incarnation
        if known is None or report.seq > known.seq:
            self._latest[key] = report
        self._publish(report.node)

    def _publish(self, node: str) -> None:
        now = CacheTotals()
        for (known, _incarnation), report in sorted(self._latest.items()):
            if known == node:
                now.add(report.totals)
        current = self._latest[(node, self._current[node])].totals
        before = self._counted.get(node, CacheTotals())
        self.metrics.touch(node)
        # Cumulative reports: a node's sums only grow (a counter never goes down).
        self.metrics.count(
            node,
            **{
                name: max(0, getattr(now, name) - getattr(before, name))
                for name in (*(name for name, _ in _COUNTERS), *_BYTES_SOURCE)
            },
        )
        self.metrics.set(node, **{name: getattr(current, name) for name, _ in _GAUGES})
        self._counted[node] = now

    def forget(self, node: str) -> None:
        """Drop ``node``'s reports and series."""
        for key in [key for key in self._latest if key[0] == node]:
            del self._latest[key]
        self._current.pop(node, None)
        self._counted.pop(node, None)
        self.metrics.forget(node)


#: The process's package cache metrics (the server's own caches, and what the Ray
#: nodes' caches reported to this server process).
CACHE_METRICS: Final = CacheMetrics(REGISTRY)
NODE_CACHE_TOTALS: Final = NodeCacheTotals(CACHE_METRICS)


# --------------------------------------------------------------------------- upstream


class HttpxUpstream:
    """Upstream fetches through ``httpx``: TLS always verified (against ``ca_bundle``
    when given, else the system/certifi roots), redirects passed back to the client."""

    def __init__(
        self,
        *,
        ca_bundle: str | os.PathLike[str] | None = None,
        timeout_sec: float = 60.0,
        max_connections: int = 64,
    ) -> None:
        verify: ssl.SSLContext | bool
        if ca_bundle is not None:
            verify = ssl.create_default_context(cafile=os.fspath(ca_bundle))
        else:
            verify = True
        self._default_resolver = connector_resolver(Connector())
        self._client = httpx.AsyncClient(
            verify=verify,
            follow_redirects=False,
            trust_env=False,
            timeout=httpx.Timeout(timeout_sec, connect=min(timeout_sec, 15.0)),
            limits=httpx.Limits(max_connections=max_connections),
        )

    async def send(
        self,
        request: CacheRequest,
        headers: Headers,
        body: AsyncIterator[bytes] | None = None,
        resolve: Resolver | None = None,
    ) -> httpx.Response:
        """Send and return the response with its body unread (the caller closes it)."""
        host, port = request.host, request.port
        default = 443 if request.scheme == "https" else 80
        host_header = host if port == default else f"{host}:{port}"
        extensions: dict[str, Any] = {}
        # Connect to the address resolved (and checked) here; TLS still verifies the name.
        address, port = await (resolve or self._default_resolver)(host, port)
        if request.scheme == "https":
            extensions["sni_hostname"] = host
        host = address
        url = httpx.URL(scheme=request.scheme, host=host, port=port).join(request.target)
        # join() normalises; keep the client's exact path and query.
        url = url.copy_with(raw_path=request.target.encode())
        upstream = self._client.build_request(
            request.method,
            url,
            headers=[("Host", host_header), *headers],
            content=body,
            extensions=extensions,
        )
        return await self._client.send(upstream, stream=True)

    async def aclose(self) -> None:
        await self._client.aclose()


# --------------------------------------------------------------------------- store


@dataclass
class Entry:
    """A stored body's metadata (``<digest>.json`` beside ``<digest>.body``)."""

    url: str
    accept: str
    kind: str
    size: int
    headers: Headers
    stored_at: float
    fresh_until: float  # 0: always revalidate
    #: When the upstream last sent or confirmed (304) this body.
    validated_at: float = 0.0
    #: Whose fill stored it (a task's key, the builds', or one trial's): what the
    #: store's fair share charges it to.
    owner: str = ""


def _key(request: CacheRequest, kind: Kind) -> tuple[str, str, str]:
    """(digest, url, accept): the URL's scheme, host, port, path and query and, but for
    an artifact (its bytes are named by its URL), the client's Accept; nothing else."""
    url = f"{request.scheme}://{request.host.lower()}:{request.port}{request.target}"
    accept = "" if kind is Kind.ARTIFACT else " ".join((request.header("accept") or "").split())
    digest = hashlib.sha256(f"{url}\n{accept}".encode()).hexdigest()
    return digest, url, accept


class CacheStore:
    """Bodies on disk with LRU eviction by bytes, shared fairly.

    Fills in flight reserve their bytes before they are written, so stored and
    in-flight bytes together never pass ``max_bytes``. Each owner (whoever fills: a
    task's trials, the builds) has a fair share, the bound over the owners present:
    room for an owner within its share is made by evicting the least recently used
    entry of an owner over its share; an owner past its share evicts only its own, and
    what it cannot fit is not stored (it is served through). A burst from one owner
    thus never evicts what the others stored within their shares.
    """

    def __init__(self, root: Path, *, max_bytes: int, max_object_bytes: int | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError("the package cache's max_bytes must be positive")
        self.root = root
        self.max_bytes = max_bytes
        self.max_object_bytes = min(max_object_bytes or max_bytes, max_bytes)
        self._tmp = root / "tmp"
        self._objects = root / "objects"
        for directory in (root, self._tmp, self._objects):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lru: OrderedDict[str, Entry] = OrderedDict()
        self.size = 0
        self.evictions = 0
        #: Bytes reserved by fills in flight, in all and per owner.
        self.in_flight = 0
        self._flying: collections.Counter[str] = collections.Counter()
        #: Bytes stored per owner.
        self._owned: collections.Counter[str] = collections.Counter()
        self._load()

    def _load(self) -> None:
        for stale in self._tmp.iterdir():
            with contextlib.suppress(OSError):
                stale.unlink()
        found: list[tuple[float, str, Entry]] = []
        for meta in self._objects.glob("*.json"):
            digest = meta.stem
            body = self._objects / f"{digest}.body"
            try:
                raw = json.loads(meta.read_text(encoding="utf-8"))
                entry = Entry(**{**raw, "headers": [tuple(h) for h in raw["headers"]]})
                if body.stat().st_size != entry.size:
                    raise ValueError("size mismatch")
                found.append((body.stat().st_atime, digest, entry))
            except (OSError, ValueError, TypeError, KeyError):
                self._remove_files(digest)
        for _atime, digest, entry in sorted(found, key=lambda item: item[0]):
            self._add(digest, entry)
        while self._lru and self.size > self.max_bytes:
            self._evict_one(next(iter(self._lru)))

    def body_path(self, digest: str) -> Path:
        return self._objects / f"{digest}.body"

    def get(self, digest: str) -> Entry | None:
        entry = self._lru.get(digest)
        if entry is not None:
            self._lru.move_to_end(digest)
        return entry

    def temp_path(self) -> Path:
        return self._tmp / secrets.token_hex(12)

    def reserve(self, owner: str, size: int) -> bool:
        """Reserve ``size`` bytes for ``owner``'s fill, evicting as its fair share allows;
        False (nothing reserved, nothing evicted) when they do not fit."""
        if size > self.max_object_bytes:
            return False
        victims = self._victims(owner, size)
        if victims is None:
            return False
        for digest in victims:
            self._evict_one(digest)
        self.in_flight += size
        self._flying[owner] += size
        return True

    def release(self, owner: str, size: int) -> None:
        """Give back a reservation (the fill ended, stored or not)."""
        self.in_flight -= size
        self._flying[owner] -= size
        if self._flying[owner] <= 0:
            del self._flying[owner]

    def _victims(self, owner: str, incoming: int) -> list[str] | None:
        """The entries to evict, oldest first, to make room for ``incoming`` bytes of
        ``owner``'s; None when its share does not allow it."""
        owners = set(self._owned) | set(self._flying) | {owner}
        share = self.max_bytes // len(owners)
        usage = collections.Counter(self._owned) + collections.Counter(self._flying)
        usage[owner] += incoming
        free = self.max_bytes - self.size - self.in_flight - incoming
        victims: list[str] = []
        for digest, entry in self._lru.items():
            if free >= 0:
                break
            # Past its share an owner makes room only from its own entries; within it,
            # from those of owners over theirs.
            mine = entry.owner == owner
            if mine if usage[owner] > share else usage[entry.owner] > share:
                victims.append(digest)
                usage[entry.owner] -= entry.size
                free += entry.size
        return victims if free >= 0 else None

    def put(self, digest: str, entry: Entry, temp: Path, *, reserved: int = 0) -> bool:
        """Move ``temp`` in as ``digest``'s body (replacing any); its bytes come out of
        ``reserved`` (what its fill reserved, given back here) or are made room for."""
        self.release(entry.owner, reserved)
        if entry.size > self.max_object_bytes:
            temp.unlink(missing_ok=True)
            return False
        self.discard(digest)
        if not self.reserve(entry.owner, entry.size):
            temp.unlink(missing_ok=True)
            return False
        self.release(entry.owner, entry.size)
        meta = self._objects / f"{digest}.json"
        meta_tmp = self.temp_path()
        meta_tmp.write_text(json.dumps(asdict(entry)), encoding="utf-8")
        os.replace(temp, self.body_path(digest))
        os.replace(meta_tmp, meta)
        self._add(digest, entry)
        return True

    def _add(self, digest: str, entry: Entry) -> None:
        self._lru[digest] = entry
        self.size += entry.size
        self._owned[entry.owner] += entry.size

    def update(self, digest: str, entry: Entry) -> None:
        """Rewrite ``digest``'s metadata (after a 304)."""
        if digest not in self._lru:
            return
        meta_tmp = self.temp_path()
        meta_tmp.write_text(json.dumps(asdict(entry)), encoding="utf-8")
        os.replace(meta_tmp, self._objects / f"{digest}.json")
        self._lru[digest] = entry

    def discard(self, digest: str) -> None:
        if digest in self._lru:
            self._drop(digest)

    def _drop(self, digest: str) -> None:
        entry = self._lru.pop(digest)
        self.size -= entry.size
        self._owned[entry.owner] -= entry.size
        if self._owned[entry.owner] <= 0:
            del self._owned[entry.owner]
        self._remove_files(digest)

    def _remove_files(self, digest: str) -> None:
        # An open reader keeps its file: unlinking only drops the name.
        for suffix in (".body", ".json"):
            with contextlib.suppress(OSError):
                (self._objects / f"{digest}{suffix}").unlink()

    def _evict_one(self, digest: str) -> None:
        self._drop(digest)
        self.evictions += 1


# --------------------------------------------------------------------------- recall

#: What one task's trials asked for, remembered: (scheme, host, port, target, accept).
Asked = tuple[str, str, int, str, str]
#: At most this many requests remembered per task (the latest trial's first).
MAX_RECALLED: Final = 256
#: A request whose target and Accept are longer is not remembered (index URLs are
#: short; a flood of long ones would only fill memory and disk).
MAX_RECALLED_KEY: Final = 1024
#: Tasks whose lists are kept in memory (the rest are read from disk again).
RECALL_MEMORY_TASKS: Final = 512
#: Revalidations ahead of a trial in flight at once.
AHEAD_CONCURRENCY: Final = 16
#: Upstream requests one trial may have open at once (fills and pass-throughs): the
#: shared pool has 64, so no trial can hold them all.
PER_TRIAL_UPSTREAM: Final = 8
#: A fill must average this many bytes a second once ``FILL_GRACE_SEC`` have passed,
#: or it stops (an upstream that drips a byte every few seconds holds nothing long).
FILL_MIN_BYTES_PER_SEC: Final = 16 * 1024
FILL_GRACE_SEC: Final = 30.0


class RecallStore:
    """Per task, the non-artifact requests its latest trials made (newest first,
    bounded), kept in memory and in ``<root>/<hash of the task key>.json`` so that a
    restarted server (or ``serve`` after ``prewarm --run-verifier``) knows them too.
    Only URLs are kept; a request's answer always comes from the store or upstream."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._known: OrderedDict[str, list[Asked]] = OrderedDict()

    def _path(self, task: str) -> Path:
        return self.root / f"{hashlib.sha256(task.encode()).hexdigest()}.json"

    def get(self, task: str) -> list[Asked]:
        known = self._known.get(task)
        if known is None:
            known = []
            with contextlib.suppress(OSError, ValueError, TypeError):
                raw = json.loads(self._path(task).read_text(encoding="utf-8"))
                known = [(str(a), str(b), int(c), str(d), str(e)) for a, b, c, d, e in raw][
                    :MAX_RECALLED
                ]
        self._keep(task, known)
        return known

    def _keep(self, task: str, known: list[Asked]) -> None:
        self._known[task] = known
        self._known.move_to_end(task)
        while len(self._known) > RECALL_MEMORY_TASKS:
            self._known.popitem(last=False)

    def add(self, task: str, asked: Sequence[Asked]) -> None:
        """Put ``asked`` first, then what was known before (each once), bounded."""
        merged = list(dict.fromkeys([*asked, *self.get(task)]))[:MAX_RECALLED]
        self._keep(task, merged)
        temp = self.root / f".{secrets.token_hex(8)}.tmp"
        try:
            temp.write_text(json.dumps(merged), encoding="utf-8")
            os.replace(temp, self._path(task))
        except OSError as exc:
            temp.unlink(missing_ok=True)
            logger.info("package cache: what %s asked was not saved: %s", task, exc)


# --------------------------------------------------------------------------- cache


def _freshness(headers: Headers, now: float) -> float:
    """Until when a response is fresh by its own headers (0: not fresh at all)."""
    values = {k.lower(): v for k, v in headers}
    cache_control = values.get("cache-control", "").lower()
    if "no-cache" in cache_control:
        return 0.0
    match = re.search(r"(?:^|[,\s])(?:s-maxage|max-age)\s*=\s*(\d+)", cache_control)
    if match:
        return now + int(match.group(1))
    expires = values.get("expires")
    if expires:
        with contextlib.suppress(TypeError, ValueError):
            parsed = email.utils.parsedate_to_datetime(expires)
            return parsed.timestamp()
    return 0.0


def _storable(response: httpx.Response) -> bool:
    if response.status_code != 200:
        return False
    cache_control = response.headers.get("cache-control", "").lower()
    if re.search(r"\b(no-store|private)\b", cache_control):
        return False
    if "set-cookie" in response.headers:
        return False
    if response.headers.get("content-encoding", "identity").lower() not in ("", "identity"):
        return False
    vary = {v.strip().lower() for v in response.headers.get("vary", "").split(",") if v.strip()}
    return vary <= _VARY_OK


def _validators(headers: Headers) -> Headers:
    values = {k.lower(): v for k, v in headers}
    out: Headers = []
    if "etag" in values:
        out.append(("If-None-Match", values["etag"]))
    if "last-modified" in values:
        out.append(("If-Modified-Since", values["last-modified"]))
    return out


class _Slot:
    """One of a trial's share of upstream requests (``PER_TRIAL_UPSTREAM``), given back
    once whoever holds it last is done."""

    def __init__(self, slots: asyncio.Semaphore) -> None:
        self.slots = slots
        self.held = False

    async def take(self) -> None:
        await self.slots.acquire()
        self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.slots.release()

    def hand_over(self) -> Callable[[], None]:
        """The release for whatever now holds it (a response's body, a download)."""
        held, self.held = self.held, False

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.slots.release()

        return release


class _Fill:
    """One upstream download into a temporary file, tailed by every reader; ``entry``
    is what will be stored once it ends."""

    def __init__(self, path: Path, length: int | None, entry: Entry) -> None:
        self.path = path
        self.length = length
        self.entry = entry
        self.written = 0
        #: Bytes reserved in the store for it (``CacheStore.reserve``).
        self.reserved = 0
        self.done = False
        self.error: BaseException | None = None
        self.changed = asyncio.Condition()
        #: Clients reading it now; the download stops when the last one leaves.
        self.readers = 0
        self.started = False
        self.stop_asked = False
        self.task: asyncio.Task[None] | None = None
        #: Called once when the download ends (gives the trial's upstream slot back).
        self.on_done: Callable[[], None] | None = None

    def leave(self) -> None:
        """A reader left: with none left, nobody waits for the bytes, so stop fetching."""
        self.readers -= 1
        if self.readers <= 0:
            self.stop()

    def stop(self) -> None:
        """Stop the download (one not started yet stops as it starts: a task cancelled
        before its first step would skip its own clean-up)."""
        self.stop_asked = True
        if self.started and not self.done and self.task is not None:
            self.task.cancel()

    async def wait_beyond(self, offset: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.done or self.written > offset)

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()


class PackageCache:
    """The host-side cache (one a server): a ``CacheStore`` filled from an upstream."""

    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int,
        max_object_bytes: int | None = None,
        upstream: HttpxUpstream | None = None,
        metrics: CacheMetrics | None = CACHE_METRICS,
        index_fresh_sec: float = 0.0,
    ) -> None:
        #: How long an index answer (stored or just revalidated) is served without
        #: asking the upstream; 0: revalidated on every request.
        self.index_fresh_sec = index_fresh_sec
        self.store = CacheStore(root, max_bytes=max_bytes, max_object_bytes=max_object_bytes)
        self.upstream = upstream if upstream is not None else HttpxUpstream()
        self.stats = CacheStats()
        self._metrics = metrics
        # Per URL key: its lock and how many requests use it (dropped at none).
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._fills: dict[str, _Fill] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: What each task's trials asked for (``revalidate_ahead``).
        self.recall = RecallStore(root / "recall")
        self._evictions_seen = self.store.evictions
        self._publish()

    def session(self, *, since: float | None = None, task: str | None = None) -> CacheSession:
        """A per-trial view: its own ``CacheStats``, summed into the cache's. ``since``
        (the trial's start): its index requests are answered with copies the upstream
        sent or confirmed after it; None: revalidate every request. ``task``: the key
        under which what it asked is remembered for ``revalidate_ahead``."""
        return CacheSession(self, since=since, task=task)

    def start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` on this cache's loop on its own (cancelled by ``aclose``)."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.upstream.aclose()

    def totals(self) -> CacheTotals:
        """This cache's own sums (all its sessions) and its store now."""
        return CacheTotals(
            **self.stats.to_dict(),
            evictions=self.store.evictions,
            stored_bytes=self.store.size,
            stored_entries=len(self.store._lru),
            bound_bytes=self.store.max_bytes,
        )

    def _publish(self) -> None:
        metrics = self._metrics
        if metrics is None:
            return
        metrics.count(SERVER_NODE, evictions=self.store.evictions - self._evictions_seen)
        self._evictions_seen = self.store.evictions
        metrics.set(
            SERVER_NODE,
            stored_bytes=self.store.size,
            stored_entries=len(self.store._lru),
            bound_bytes=self.store.max_bytes,
        )

    def _count(self, session: CacheStats, **deltas: int) -> None:
        for stats in (session, self.stats):
            for name, delta in deltas.items():
                setattr(stats, name, getattr(stats, name) + delta)
        if self._metrics is not None:
            self._metrics.count(SERVER_NODE, **deltas)

    # ------------------------------------------------------------------ answering

    async def handle(self, request: CacheRequest, session: CacheSession) -> CacheResponse:
        """Answer ``request`` from the cache or the upstream (an upstream failure is
        a 502)."""
        stats = session.stats
        self._count(stats, requests=1)
        method = request.method.upper()
        cacheable = (
            method in ("GET", "HEAD")
            and request.header("authorization") is None
            and request.header("cookie") is None
        )
        try:
            if cacheable:
                return await self._cached(request, session, head=method == "HEAD")
            return await self._passthrough(request, session)
        except EgressRefused as exc:
            self._count(stats, upstream_errors=1)
            message = f"harbor-exec package cache: {request.host}: {exc.reason}\n"
            return _bytes_response(403, "Forbidden", message.encode(), "pass")
        except httpx.HTTPError as exc:
            self._count(stats, upstream_errors=1)
            logger.info(
                "package cache: %s %s://%s%s failed: %s",
                method,
                request.scheme,
                request.host,
                request.target,
                exc,
            )
            failed = f"upstream request failed: {type(exc).__name__}: {exc}\n"
            return _bytes_response(502, "Bad Gateway", failed.encode(), "pass")

    async def _passthrough(self, request: CacheRequest, session: CacheSession) -> CacheResponse:
        stats = session.stats
        headers = [
            (k, v)
            for k, v in request.headers
            if k.lower() not in _HOP_BY_HOP and k.lower() not in ("host", "content-length")
        ]
        if request.body is not None:
            length = request.header("content-length")
            if length is not None:
                headers.append(("Content-Length", length))
        slot = _Slot(session.upstream_slots)
        await slot.take()
        try:
            response = await self._send(request, headers, stats, request.body)
        except BaseException:
            slot.give_back()
            raise
        self._count(stats, passthrough=1)
        head = request.method.upper() == "HEAD"
        return self._stream_upstream(response, stats, head=head, release=slot.hand_over())

    async def _send(
        self,
        request: CacheRequest,
        headers: Headers,
        stats: CacheStats,
        body: AsyncIterator[bytes] | None = None,
    ) -> httpx.Response:
        """One upstream request, counted once it leaves (a refused one never does)."""
        try:
            response = await self.upstream.send(request, headers, body, request.resolve)
        except httpx.HTTPError:
            self._count(stats, upstream_requests=1)
            raise
        self._count(stats, upstream_requests=1)
        return response

    def _stream_upstream(
        self,
        response: httpx.Response,
        stats: CacheStats,
        *,
        head: bool,
        source: str = "pass",
        release: Callable[[], None] | None = None,
    ) -> CacheResponse:
        headers = [
            (k, v) for k, v in response.headers.multi_items() if k.lower() not in _HOP_BY_HOP
        ]

        async def body() -> AsyncIterator[bytes]:
            try:
                if head:
                    return
                async for chunk in response.aiter_raw(_CHUNK):
                    self._count(stats, bytes_from_upstream=len(chunk))
                    yield chunk
            finally:
                await response.aclose()
                if release is not None:
                    release()

        return CacheResponse(response.status_code, response.reason_phrase, headers, body(), source)

    def _upstream_headers(self, request: CacheRequest, accept: str) -> Headers:
        headers: Headers = [("User-Agent", USER_AGENT), ("Accept-Encoding", "identity")]
        if accept:
            headers.append(("Accept", accept))
        return headers

    async def _cached(
        self, request: CacheRequest, session: CacheSession, *, head: bool
    ) -> CacheResponse:
        kind = classify(request.host, request.path)
        digest, url, accept = _key(request, kind)
        slot = _Slot(session.upstream_slots)
        try:
            while True:
                async with self._url_lock(digest):
                    response = await self._cached_locked(
                        request, session, digest, url, accept, kind, head=head, slot=slot
                    )
                if response is not None:
                    break
                # The trial's upstream share is taken: wait for it without holding the
                # URL's lock (another trial asking for the same URL goes on), then ask again.
                await slot.take()
        except BaseException:
            slot.give_back()
            raise
        if kind is not Kind.ARTIFACT and response.source != "pass":
            session.remember(request, accept)
        return response

    @contextlib.asynccontextmanager
    async def _url_lock(self, digest: str) -> AsyncIterator[None]:
        """One request at a time per URL key (the lock dropped when nobody uses it)."""
        lock, users = self._locks.get(digest) or (asyncio.Lock(), 0)
        self._locks[digest] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[digest]
            if users <= 1:
                del self._locks[digest]
            else:
                self._locks[digest] = (lock, users - 1)

    def _current(self, entry: Entry, now: float, since: float | None) -> str | None:
        """How ``entry`` may be served without asking the upstream ("hit": named by its
        content or fresh; "revalidated": the upstream confirmed it after ``since``)."""
        if entry.kind == Kind.ARTIFACT or (entry.fresh_until and now < entry.fresh_until):
            return "hit"
        if since is not None and entry.validated_at >= since:
            return "revalidated"
        return None

    async def _cached_locked(
        self,
        request: CacheRequest,
        session: CacheSession,
        digest: str,
        url: str,
        accept: str,
        kind: Kind,
        *,
        head: bool,
        slot: _Slot,
    ) -> CacheResponse | None:
        """The answer; None when it needs the upstream and ``slot`` (one of the trial's
        share of upstream requests) is not held and cannot be taken at once."""
        stats = session.stats
        filling = self._fills.get(digest)
        if filling is not None:
            slot.give_back()
            self._count(stats, hits=1)
            return self._from_fill(filling, stats, head=head)
        entry = self.store.get(digest)
        now = time.time()
        if entry is not None:
            served = self._current(entry, now, session.since)
            if served is not None:
                slot.give_back()
                self._count(stats, **{"hits" if served == "hit" else "revalidated": 1})
                return self._from_store(digest, entry, stats, head=head, source=served)
        if not slot.held:
            if slot.slots.locked():
                return None
            await slot.take()  # free: taken without waiting
        outcome = await self._refresh(
            request, stats, digest, url, accept, kind, entry, now, session.owner
        )
        if isinstance(outcome, Entry):
            slot.give_back()
            self._count(stats, revalidated=1)
            return self._from_store(digest, outcome, stats, head=head, source="revalidated")
        if isinstance(outcome, _Fill):
            # Held until the download ends, whoever reads it.
            outcome.on_done = slot.hand_over()
            session.track(outcome)
            self._count(stats, misses=1)
            return self._from_fill(outcome, stats, head=head, upstream=True)
        self._count(stats, passthrough=1)
        return self._stream_upstream(outcome, stats, head=head, release=slot.hand_over())

    async def _refresh(
        self,
        request: CacheRequest,
        stats: CacheStats,
        digest: str,
        url: str,
        accept: str,
        kind: Kind,
        entry: Entry | None,
        now: float,
        owner: str,
    ) -> Entry | _Fill | httpx.Response:
        """Ask the upstream for ``url`` (conditionally when ``entry`` is stored) and
        apply its answer to the store: the revalidated entry after a 304; the fill of a
        new body that is worth storing (its download runs on its own); else the
        response, unread, to pass through (a stale entry is dropped)."""
        headers = self._upstream_headers(request, accept)
        if entry is not None:
            headers += _validators(entry.headers)
        response = await self._send(
            CacheRequest(
                "GET",
                request.scheme,
                request.host,
                request.port,
                request.target,
                resolve=request.resolve,
            ),
            headers,
            stats,
        )
        if response.status_code == 304 and entry is not None:
            await response.aclose()
            refreshed = _merge_304(entry, response, now, self._index_fresh_until(now))
            self.store.update(digest, refreshed)
            return refreshed
        if not self._worth_storing(response, kind):
            if entry is not None:
                self.store.discard(digest)
                self._publish()
            return response
        length_header = response.headers.get("content-length")
        length = int(length_header) if length_header and length_header.isdigit() else None
        if length is not None and not self.store.reserve(owner, length):
            return response  # past the object bound or its owner's share: served through
        stored_headers = [
            (k, v) for k, v in response.headers.multi_items() if k.lower() in _STORED_HEADERS
        ]
        new_entry = Entry(
            url=url,
            accept=accept,
            kind=kind.value,
            size=length or 0,
            headers=stored_headers,
            stored_at=now,
            fresh_until=(
                self._index_fresh_until(now)
                if kind == Kind.INDEX
                else _freshness(stored_headers, now)
            ),
            validated_at=now,
            owner=owner,
        )
        fill = _Fill(self.store.temp_path(), length, new_entry)
        fill.reserved = length or 0
        try:
            out = fill.path.open("wb")  # exists before any reader opens it
        except BaseException:
            self.store.release(owner, fill.reserved)
            await response.aclose()
            raise
        self._fills[digest] = fill
        fill.task = self.start(self._download(digest, response, fill, out))
        return fill

    async def revalidate_ahead(self, session: CacheSession, resolve: Resolver | None) -> None:
        """Revalidate, concurrently, the stored entries that ``session``'s task asked
        for in its earlier trials and that its requests could not be served without
        asking (``_current``), so that they find them confirmed. Nothing that is not
        stored is fetched; an answer that changed is stored as a request's would be."""
        if session.task is None or session.since is None:
            return
        recalled = self.recall.get(session.task)
        gate = asyncio.Semaphore(AHEAD_CONCURRENCY)

        async def one(scheme: str, host: str, port: int, target: str, accept: str) -> None:
            headers = [("Accept", accept)] if accept else []
            request = CacheRequest("GET", scheme, host, port, target, headers, resolve=resolve)
            kind = classify(host, request.path)
            digest, url, accept = _key(request, kind)
            async with gate, self._url_lock(digest):
                entry = self.store.get(digest)
                now = time.time()
                if digest in self._fills or entry is None:
                    return
                if self._current(entry, now, session.since) is not None:
                    return
                self._count(session.stats, revalidated_ahead=1)
                try:
                    outcome = await self._refresh(
                        request, session.stats, digest, url, accept, kind, entry, now, session.owner
                    )
                except (EgressRefused, httpx.HTTPError) as exc:
                    self._count(session.stats, upstream_errors=1)
                    logger.info("package cache: revalidating %s ahead failed: %s", url, exc)
                    return
                if isinstance(outcome, httpx.Response):
                    await outcome.aclose()

        await asyncio.gather(*(one(*item) for item in recalled))

    def _index_fresh_until(self, now: float) -> float:
        return now + self.index_fresh_sec if self.index_fresh_sec > 0 else 0.0

    def _worth_storing(self, response: httpx.Response, kind: Kind) -> bool:
        if not _storable(response):
            return False
        headers = list(response.headers.multi_items())
        has_validators = bool(_validators(headers))
        if kind == Kind.ARTIFACT:
            return True
        if kind == Kind.INDEX:
            return has_validators
        return has_validators or _freshness(headers, time.time()) > time.time()

    async def _download(self, digest: str, response: httpx.Response, fill: _Fill, out: Any) -> None:
        entry = fill.entry
        started = time.monotonic()
        fill.started = True
        try:
            with out:
                if fill.stop_asked:
                    raise asyncio.CancelledError
                # As the bytes arrive (a fixed chunk size would wait for a whole chunk
                # from a dripping upstream before the rate is ever checked).
                async for chunk in response.aiter_raw():
                    out.write(chunk)
                    out.flush()
                    fill.written += len(chunk)
                    if fill.written > self.store.max_object_bytes:
                        raise ValueError("larger than the cache's object bound")
                    if fill.written > fill.reserved:
                        # No length given (or more than it said): room as the bytes come.
                        more = fill.written - fill.reserved
                        if not self.store.reserve(entry.owner, more):
                            raise ValueError("no room for it in the cache (its bound or share)")
                        fill.reserved += more
                    elapsed = time.monotonic() - started
                    if elapsed > FILL_GRACE_SEC and fill.written < FILL_MIN_BYTES_PER_SEC * elapsed:
                        raise ValueError(
                            f"the upstream sent {fill.written} bytes in {elapsed:.0f} s, under "
                            f"{FILL_MIN_BYTES_PER_SEC} bytes a second"
                        )
                    await fill.notify()
            if fill.length is not None and fill.written != fill.length:
                raise ValueError(f"body of {fill.written} bytes, expected {fill.length}")
            entry.size = fill.written
            reserved, fill.reserved = fill.reserved, 0
            self.store.put(digest, entry, fill.path, reserved=reserved)
        except BaseException as exc:  # readers must learn of every end
            fill.error = exc
            fill.path.unlink(missing_ok=True)
            self.store.release(entry.owner, fill.reserved)
            fill.reserved = 0
            if not isinstance(exc, asyncio.CancelledError | ValueError | httpx.HTTPError | OSError):
                raise
            logger.info("package cache: download of %s failed: %s", entry.url, exc)
        finally:
            await response.aclose()
            fill.done = True
            if fill.on_done is not None:
                fill.on_done()
            self._fills.pop(digest, None)
            self._publish()
            await fill.notify()

    def _entry_headers(self, entry: Entry, length: int | None, source: str) -> Headers:
        headers = list(entry.headers)
        if length is not None:
            headers.append(("Content-Length", str(length)))
        headers.append(("X-Cache", source.upper()))
        return headers

    def _from_store(
        self, digest: str, entry: Entry, stats: CacheStats, *, head: bool, source: str
    ) -> CacheResponse:
        handle = self.store.body_path(digest).open("rb")  # open now: eviction only unlinks

        async def body() -> AsyncIterator[bytes]:
            try:
                if head:
                    return
                while chunk := handle.read(_CHUNK):
                    self._count(stats, bytes_from_cache=len(chunk))
                    yield chunk
            finally:
                handle.close()

        headers = self._entry_headers(entry, entry.size, source)
        return CacheResponse(200, "OK", headers, body(), source)

    def _from_fill(
        self, fill: _Fill, stats: CacheStats, *, head: bool, upstream: bool = False
    ) -> CacheResponse:
        counter = "bytes_from_upstream" if upstream else "bytes_from_cache"
        source = "miss" if upstream else "hit"

        handle = fill.path.open("rb")  # open now: the finished file is renamed away
        if head:
            handle.close()
            return CacheResponse(
                200, "OK", self._entry_headers(fill.entry, fill.length, source), _empty(), source
            )

        async def body() -> AsyncIterator[bytes]:
            # Counted once it reads (an answer never sent never starts its body).
            fill.readers += 1
            try:
                offset = 0
                with handle:
                    while True:
                        chunk = handle.read(_CHUNK)
                        if chunk:
                            offset += len(chunk)
                            self._count(stats, **{counter: len(chunk)})
                            yield chunk
                            continue
                        if fill.done:
                            if fill.error is not None:
                                # The trial's record says its body was cut, and why.
                                self._count(stats, upstream_errors=1)
                                raise ConnectionError(f"upstream download failed: {fill.error}")
                            return
                        await fill.wait_beyond(offset)
            finally:
                fill.leave()

        headers = self._entry_headers(fill.entry, fill.length, source)
        return CacheResponse(200, "OK", headers, body(), source)


async def _empty() -> AsyncIterator[bytes]:
    return
    yield b""  # an async generator with nothing to give


def _merge_304(entry: Entry, response: httpx.Response, now: float, index_fresh: float) -> Entry:
    updated = {k.lower(): (k, v) for k, v in entry.headers}
    for key, value in response.headers.multi_items():
        if key.lower() in _STORED_HEADERS and key.lower() != "content-type":
            updated[key.lower()] = (key, value)
    headers = list(updated.values())
    fresh = index_fresh if entry.kind == Kind.INDEX else _freshness(headers, now)
    return Entry(
        url=entry.url,
        accept=entry.accept,
        kind=entry.kind,
        size=entry.size,
        headers=headers,
        stored_at=entry.stored_at,
        fresh_until=fresh,
        validated_at=now,
    )


def _bytes_response(status: int, reason: str, data: bytes, source: str) -> CacheResponse:
    async def body() -> AsyncIterator[bytes]:
        yield data

    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    return CacheResponse(status, reason, headers, body(), source)


class Answering(Protocol):
    """What serves a connection's requests: a ``CacheSession`` or a bridge to one."""

    async def handle(self, request: CacheRequest) -> CacheResponse: ...


class CacheSession:
    """One trial's use of the cache: what it asked, and from where it came.

    ``since``: when the trial began (``PackageCache.session``); ``task``: the key its
    requests are remembered under, for the task's next trials (``finish``)."""

    def __init__(
        self, cache: PackageCache, *, since: float | None = None, task: str | None = None
    ) -> None:
        self.cache = cache
        self.since = since
        self.task = task
        self.stats = CacheStats()
        #: Non-artifact requests answered from or into the store, in order.
        self.asked: dict[Asked, None] = {}
        #: This trial's share of the upstream connections (``PER_TRIAL_UPSTREAM``).
        self.upstream_slots = asyncio.Semaphore(PER_TRIAL_UPSTREAM)
        #: The downloads its requests started (``finish`` stops those nobody reads).
        self.fills: set[_Fill] = set()
        #: Whom the store charges this session's fills to: its task's trials together,
        #: else this trial alone.
        self.owner = f"task:{task}" if task is not None else f"trial:{secrets.token_hex(6)}"

    async def handle(self, request: CacheRequest) -> CacheResponse:
        return await self.cache.handle(request, self)

    def remember(self, request: CacheRequest, accept: str) -> None:
        key = (request.scheme, request.host.lower(), request.port, request.target, accept)
        if len(self.asked) < MAX_RECALLED and len(request.target) + len(accept) <= MAX_RECALLED_KEY:
            self.asked[key] = None

    def track(self, fill: _Fill) -> None:
        """A download this session's request started (the ended ones are let go: a
        session that lives long, as the builds', keeps only those in flight)."""
        self.fills = {f for f in self.fills if not f.done}
        self.fills.add(fill)

    def finish(self) -> None:
        """Keep what this trial asked for, for its task's next ``revalidate_ahead``; stop
        the downloads it started that nobody reads (they end with the trial)."""
        if self.task is not None and self.asked:
            self.cache.recall.add(self.task, list(self.asked))
        for fill in self.fills:
            if fill.readers == 0:
                fill.stop()
        self.fills.clear()

    def write(self, path: Path) -> None:
        """``package-cache.json`` in a trial's result directory."""
        path.write_text(json.dumps(self.stats.to_dict(), indent=2) + "\n", encoding="utf-8")


def header_list(raw: Sequence[tuple[bytes, bytes]] | Mapping[str, str]) -> Headers:
    """h11's (bytes, bytes) pairs (or a mapping) as str pairs."""
    if isinstance(raw, Mapping):
        return list(raw.items())
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]
