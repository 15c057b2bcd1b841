"""The package cache on loopback: a real TLS-terminating tunnel in front of real local
upstreams (HTTP and HTTPS on 127.0.0.1), a real httpx client through it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import ssl
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import certifi
import httpx
import pytest
from cryptography import x509

from harbor_exec.container.forward import ForwarderThread
from harbor_exec.network.egress.policy import EgressMode, EgressPolicy
from harbor_exec.network.egress.proxy import Connector, EgressProxy, EgressProxyThread
from harbor_exec.network.packages import cache as cache_module
from harbor_exec.network.packages.ca import CA_KEY, LocalCA
from harbor_exec.network.packages.cache import (
    CacheMetrics,
    CacheSession,
    CacheStats,
    HttpxUpstream,
    Kind,
    PackageCache,
    classify,
    connector_resolver,
)
from harbor_exec.network.packages.hosts import TlsHosts
from harbor_exec.network.packages.serve import CacheUpstream
from harbor_exec.network.packages.service import (
    PackageCacheConfig,
    PackageCacheService,
    default_max_bytes,
)
from harbor_exec.network.packages.trust import subject_hash
from tests.package_upstream import TEST_TLS_HOSTS, Upstream, serve_upstream, sni_context

NAMES = ("files.test", "pypi.test", "deb.test", "elsewhere.test")


@pytest.fixture
def upstream_ca(tmp_path: Path) -> LocalCA:
    """The upstreams' own CA (a different one from the cache's)."""
    return LocalCA(tmp_path / "upstream-ca")


@pytest.fixture
def https_upstream(upstream_ca: LocalCA) -> Iterator[Upstream]:
    context = sni_context(upstream_ca)
    with serve_upstream(context) as upstream:
        yield upstream


@pytest.fixture
def http_upstream() -> Iterator[Upstream]:
    with serve_upstream() as upstream:
        yield upstream


class Trials:
    """The production path on loopback, one egress proxy (and session) per trial:
    client -> 127.0.0.1 forwarder (the runtime's) -> unix socket -> EgressProxy ->
    CacheUpstream -> the shared PackageCache -> a local upstream (TLS verified)."""

    def __init__(
        self, cache: PackageCache, ca: LocalCA, root: Path, overrides: dict[str, tuple[str, int]]
    ) -> None:
        self.cache = cache
        self.ca = ca
        self.root = root
        self.overrides = overrides
        self.trials: dict[str, tuple[EgressProxy, ForwarderThread, int, CacheSession]] = {}

    async def begin(self, trial: str, task: str) -> None:
        """A trial of ``task`` starts (as ``TrialCache.begin``): its session remembers
        what it asks and answers with what the upstream confirmed from now on; what the
        task asked before is revalidated ahead, awaited here with what it stored."""
        session = self.cache.session(task=task)
        session.since = time.time()
        await self.port(trial, session)
        resolve = connector_resolver(Connector(self.overrides, dns=False))
        await self.cache.revalidate_ahead(session, resolve)
        await asyncio.gather(*self.cache._tasks)

    def finish(self, trial: str) -> None:
        self.trials[trial][3].finish()

    async def port(self, trial: str, session: CacheSession | None = None) -> int:
        if trial not in self.trials:
            session = session or self.cache.session()
            proxy = EgressProxy(
                directory=self.root / f"egress-{trial}",
                trial=trial,
                overrides=self.overrides,
                dns=False,
                upstream=CacheUpstream(session, self.ca, tls_hosts=TlsHosts(TEST_TLS_HOSTS)),
            )
            await proxy.start()
            await proxy.set_phase("verifier", EgressPolicy(EgressMode.PUBLIC))
            forwarder = ForwarderThread(str(proxy.socket_path))
            self.trials[trial] = (proxy, forwarder, forwarder.start(), session)
        return self.trials[trial][2]

    def stats(self, trial: str = "default") -> CacheStats:
        return self.trials[trial][3].stats

    async def aclose(self) -> None:
        for proxy, forwarder, _port, _session in self.trials.values():
            forwarder.close()
            await proxy.aclose()
        await self.cache.aclose()


@asynccontextmanager
async def harness(
    tmp_path: Path,
    upstream_ca: LocalCA,
    *upstreams: Upstream,
    max_bytes: int = 10_000_000,
    ca_bundle: Path | None = None,
    index_fresh_sec: float = 0.0,
) -> AsyncIterator[Trials]:
    """Every test name -> the first (HTTPS) upstream; port 80 -> the last (HTTP) one."""
    https, http = upstreams[0], upstreams[-1]
    overrides = {name: ("127.0.0.1", https.port) for name in NAMES}
    overrides |= {f"{name}:80": ("127.0.0.1", http.port) for name in NAMES}
    cache = PackageCache(
        tmp_path / "store",
        max_bytes=max_bytes,
        upstream=HttpxUpstream(ca_bundle=ca_bundle or upstream_ca.cert_path),
        metrics=CacheMetrics(),
        index_fresh_sec=index_fresh_sec,
    )
    trials = Trials(cache, LocalCA(tmp_path / "cache-ca"), tmp_path, overrides)
    try:
        yield trials
    finally:
        await trials.aclose()


@asynccontextmanager
async def client(front: Trials, trial: str = "default") -> AsyncIterator[httpx.AsyncClient]:
    context = ssl.create_default_context(cafile=str(front.ca.cert_path))
    port = await front.port(trial)
    async with httpx.AsyncClient(
        proxy=f"http://127.0.0.1:{port}", verify=context, trust_env=False
    ) as http_client:
        yield http_client


WHEEL = "/packages/aa/bb/demo-1.0-py3-none-any.whl"


async def test_artifact_miss_then_hit_serves_the_upstreams_bytes(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    https_upstream.set(WHEEL, b"wheel-bytes" * 1000)
    async with harness(tmp_path, upstream_ca, https_upstream) as front:
        async with client(front, "t1") as c1, client(front, "t2") as c2:
            first = await c1.get(f"https://files.test{WHEEL}")
            # An artifact is named by its URL: another Accept gets the same bytes.
            second = await c2.get(f"https://files.test{WHEEL}", headers={"Accept": "*/*"})
            head = await c2.head(f"https://files.test{WHEEL}")
        assert first.status_code == second.status_code == 200
        assert first.content == second.content == b"wheel-bytes" * 1000
        assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "HIT")
        assert head.status_code == 200 and head.headers["content-length"] == "11000"
        assert https_upstream.count(WHEEL) == 1
        assert front.stats("t1").misses == 1 and front.stats("t1").bytes_from_upstream == 11000
        t2 = front.stats("t2")
        assert (t2.hits, t2.misses, t2.upstream_requests, t2.bytes_from_cache) == (2, 0, 0, 11000)


async def test_a_client_cannot_change_what_is_stored_for_a_url(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    https_upstream.set(WHEEL, b"genuine")
    async with harness(tmp_path, upstream_ca, https_upstream) as front:
        async with client(front, "attacker") as attacker:
            poisoned = await attacker.get(
                f"https://files.test{WHEEL}",
                headers={
                    "Host": "evil.test",
                    "X-Forwarded-Host": "evil.test",
                    "Range": "bytes=0-2",
                    "If-None-Match": '"x"',
                    "Cache-Control": "max-age=999999",
                    "User-Agent": "attacker",
                },
            )
            # Requests with a body or credentials pass through and are not stored.
            await attacker.post(f"https://files.test{WHEEL}", content=b"fake wheel")
            await attacker.get(
                f"https://files.test{WHEEL}?x=1", headers={"Authorization": "Bearer t"}
            )
        async with client(front, "victim") as victim:
            got = await victim.get(f"https://files.test{WHEEL}")
        assert poisoned.content == b"genuine"  # whole body from the upstream, Range ignored
        assert got.content == b"genuine" and got.headers["x-cache"] == "HIT"
        (fetch,) = [s for s in https_upstream.seen if s.method == "GET" and s.path == WHEEL]
        # Nothing the client sent reached the upstream's cacheable request.
        assert fetch.headers["host"] == "files.test"
        for name in ("x-forwarded-host", "range", "if-none-match", "cache-control"):
            assert name not in fetch.headers
        assert fetch.headers["user-agent"].startswith("harbor-exec-package-cache")
        assert front.stats("attacker").passthrough == 2
        assert https_upstream.count(f"{WHEEL}?x=1") == 1
        assert front.cache.store.size == len(b"genuine")


async def test_an_index_is_revalidated_and_a_new_release_appears(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    index = "/simple/demo/"
    https_upstream.set(index, b"<a>demo-1.0</a>", headers={"Cache-Control": "max-age=600"})
    async with harness(tmp_path, upstream_ca, https_upstream) as front:
        async with client(front) as c:
            first = await c.get(f"https://pypi.test{index}")
            same = await c.get(f"https://pypi.test{index}")
            https_upstream.set(index, b"<a>demo-1.0</a><a>demo-2.0</a>")
            changed = await c.get(f"https://pypi.test{index}")
        assert first.headers["x-cache"] == "MISS"
        assert same.headers["x-cache"] == "REVALIDATED" and same.content == first.content
        assert changed.content == b"<a>demo-1.0</a><a>demo-2.0</a>"
        assert https_upstream.count(index, 304) == 1 and https_upstream.count(index, 200) == 2
        assert front.stats().revalidated == 1


async def test_an_index_fresh_window_serves_without_asking_then_revalidates(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    index = "/simple/demo/"
    https_upstream.set(index, b"<a>demo-1.0</a>")
    async with harness(tmp_path, upstream_ca, https_upstream, index_fresh_sec=0.5) as front:
        async with client(front) as c:
            first = await c.get(f"https://pypi.test{index}")
            https_upstream.set(index, b"<a>demo-1.0</a><a>demo-2.0</a>")
            within = await c.get(f"https://pypi.test{index}")
            assert https_upstream.count(index) == 1  # not asked within the window
            await asyncio.gather(*front.cache._tasks)  # the fill is stored
            (stored,) = front.cache.store._lru.values()
            assert stored.fresh_until > 0
            # Past the window (moved there, not slept): asked again, the new release.
            stored.fresh_until = 1.0
            after = await c.get(f"https://pypi.test{index}")
        assert first.headers["x-cache"] == "MISS" and within.headers["x-cache"] == "HIT"
        assert within.content == b"<a>demo-1.0</a>"
        assert after.content == b"<a>demo-1.0</a><a>demo-2.0</a>"
        assert https_upstream.count(index) == 2


async def test_a_trial_is_answered_with_indexes_confirmed_after_it_began(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    index = "/simple/demo/"
    https_upstream.set(index, b"<a>demo-1.0</a>")
    async with harness(tmp_path, upstream_ca, https_upstream) as front:
        await front.begin("t1", task="demo")
        async with client(front, "t1") as c:
            first = await c.get(f"https://pypi.test{index}")
            await asyncio.gather(*front.cache._tasks)  # stored
            again = await c.get(f"https://pypi.test{index}")
        # Within one trial, the copy the upstream sent it serves it again unasked.
        assert (first.headers["x-cache"], again.headers["x-cache"]) == ("MISS", "REVALIDATED")
        assert again.content == first.content and https_upstream.count(index) == 1

        # The next trial began after the upstream changed: it is asked again.
        https_upstream.set(index, b"<a>demo-1.0</a><a>demo-2.0</a>")
        await front.begin("t2", task="another")  # nothing recalled for this task
        async with client(front, "t2") as c:
            second = await c.get(f"https://pypi.test{index}")
        assert second.content == b"<a>demo-1.0</a><a>demo-2.0</a>"
        assert https_upstream.count(index, 200) == 2
        assert front.stats("t2").revalidated_ahead == 0


async def test_what_a_task_asked_is_revalidated_ahead_of_its_next_trial(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    index, page, script = "/simple/demo/", "/simple/other/", "/uv/install.sh"
    https_upstream.set(index, b"<a>demo-1.0</a>")
    https_upstream.set(page, b"<a>other-1.0</a>")
    https_upstream.set(script, b"#!/bin/sh\necho uv\n")  # validators, no freshness
    https_upstream.set(WHEEL, b"wheel")
    urls = [f"https://pypi.test{index}", f"https://pypi.test{page}", f"https://files.test{script}"]
    html = "text/html"
    async with harness(tmp_path, upstream_ca, https_upstream) as front:
        await front.begin("t1", task="demo")
        async with client(front, "t1") as c:
            # The agent's own headers: none of them is remembered or sent ahead.
            hostile = {"Accept": html, "X-Agent": "evil", "If-None-Match": '"forged"'}
            for url in urls:
                await c.get(url, headers=hostile)
            await c.get(f"https://files.test{WHEEL}")
        await asyncio.gather(*front.cache._tasks)
        front.finish("t1")

        https_upstream.set(index, b"<a>demo-1.0</a><a>demo-2.0</a>")  # a new release
        before = len(https_upstream.seen)
        await front.begin("t2", task="demo")
        ahead = https_upstream.seen[before:]
        # Each remembered index and the script once, concurrently, before any request;
        # the artifact (named by its content) is never asked again.
        assert sorted(s.path for s in ahead) == sorted([index, page, script])
        assert sorted(s.status for s in ahead) == [200, 304, 304]
        for seen in ahead:
            assert "x-agent" not in seen.headers and seen.headers.get("if-none-match") != '"forged"'
            assert seen.headers["accept"] == html
        assert front.stats("t2").revalidated_ahead == 3
        assert front.stats("t2").upstream_requests == 3

        async with client(front, "t2") as c:
            answers = [await c.get(url, headers={"Accept": html}) for url in urls]
            wheel = await c.get(f"https://files.test{WHEEL}")
        # The trial asked nothing itself, and still saw the new release.
        assert len(https_upstream.seen) == before + 3
        assert answers[0].content == b"<a>demo-1.0</a><a>demo-2.0</a>"
        assert [a.headers["x-cache"] for a in answers] == ["REVALIDATED"] * 3
        assert wheel.headers["x-cache"] == "HIT"
        t2 = front.stats("t2")
        assert (t2.requests, t2.revalidated, t2.hits, t2.misses) == (4, 3, 1, 0)

        # What a task asked survives a restart of the cache (the same store).
        remembered = front.cache.recall.get("demo")
    reopened = PackageCache(tmp_path / "store", max_bytes=10_000_000, metrics=None)
    assert reopened.recall.get("demo") == remembered and len(remembered) == 3
    await reopened.aclose()


async def test_revalidating_ahead_is_bounded_and_fetches_nothing_new(
    tmp_path: Path,
    upstream_ca: LocalCA,
    https_upstream: Upstream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cache_module, "MAX_RECALLED", 2)
    monkeypatch.setattr(cache_module, "RECALL_MEMORY_TASKS", 1)
    pages = [f"/simple/p{i}/" for i in range(5)]
    for page in pages:
        https_upstream.set(page, b"<a>page</a>")
    https_upstream.set("/simple/unstored/", b"no validators", etag=False)
    long_page = "/simple/" + "x" * 1100 + "/"
    https_upstream.set(long_page, b"<a>long</a>")
    async with harness(tmp_path, upstream_ca, https_upstream) as front:
        await front.begin("t1", task="flood")
        async with client(front, "t1") as c:
            # Too long a key is not remembered, nor is an answer that was not stored.
            for page in [long_page, "/simple/unstored/", *pages]:
                await c.get(f"https://pypi.test{page}")
        await asyncio.gather(*front.cache._tasks)
        front.finish("t1")
        remembered = front.cache.recall.get("flood")
        # At most the bound (the first asked).
        assert [target for _s, _h, _p, target, _a in remembered] == pages[:2]
        # Only so many tasks' lists stay in memory; the others are read back from disk.
        front.cache.recall.add("another", [("https", "pypi.test", 443, "/simple/a/", "")])
        assert list(front.cache.recall._known) == ["another"]
        assert front.cache.recall.get("flood") == remembered

        # A remembered entry that left the store is not fetched ahead.
        evicted = [d for d, e in front.cache.store._lru.items() if e.url.endswith(pages[0])]
        front.cache.store.discard(evicted[0])
        before = len(https_upstream.seen)
        await front.begin("t2", task="flood")
        assert [s.path for s in https_upstream.seen[before:]] == [pages[1]]
        assert front.stats("t2").revalidated_ahead == 1


async def test_an_index_without_validators_is_not_stored(
    tmp_path: Path, upstream_ca: LocalCA, http_upstream: Upstream
) -> None:
    lists = "/debian/dists/stable/InRelease"
    http_upstream.set(lists, b"Origin: Debian", etag=False)
    async with harness(tmp_path, upstream_ca, http_upstream) as front:
        async with client(front) as c:
            for _ in range(2):
                got = await c.get(f"http://deb.test{lists}")
                assert got.content == b"Origin: Debian" and got.headers.get("x-cache") is None
        assert http_upstream.count(lists) == 2 and front.cache.store.size == 0


async def test_only_successful_cacheable_gets_are_stored(
    tmp_path: Path, upstream_ca: LocalCA, http_upstream: Upstream
) -> None:
    http_upstream.set("/pool/a.deb", b"gone", status=404)
    http_upstream.set("/pool/b.deb", b"", status=302, headers={"Location": "/pool/c.deb"})
    http_upstream.set("/pool/c.deb", b"secret", headers={"Cache-Control": "private"})
    http_upstream.set("/pool/d.deb", b"session", headers={"Set-Cookie": "s=1"})
    http_upstream.set("/pool/e.deb", b"nostore", headers={"Cache-Control": "no-store"})
    http_upstream.set("/pool/f.deb", b"varies", headers={"Vary": "Cookie"})
    async with harness(tmp_path, upstream_ca, http_upstream) as front:
        async with client(front) as c:
            for name in "abcdef":
                for _ in range(2):
                    got = await c.get(f"http://deb.test/pool/{name}.deb")
                    assert got.headers.get("x-cache") is None
            assert (await c.get("http://deb.test/pool/b.deb")).status_code == 302
        for name in "acdef":
            assert http_upstream.count(f"/pool/{name}.deb") == 2
        assert front.cache.store.size == 0 and front.stats().passthrough == 13


async def test_the_cache_stays_within_its_bound_evicting_least_recently_used(
    tmp_path: Path, upstream_ca: LocalCA, http_upstream: Upstream
) -> None:
    for i in range(6):
        http_upstream.set(f"/pool/{i}.deb", bytes([65 + i]) * 1000)
    async with harness(tmp_path, upstream_ca, http_upstream, max_bytes=3000) as front:
        async with client(front) as c:
            for i in range(3):
                await c.get(f"http://deb.test/pool/{i}.deb")
            await c.get("http://deb.test/pool/0.deb")  # 0 is now the most recent
            for i in range(3, 5):
                await c.get(f"http://deb.test/pool/{i}.deb")
                assert front.cache.store.size <= 3000
            kept = {e.url.rsplit("/", 1)[1] for e in front.cache.store._lru.values()}
            assert kept == {"0.deb", "3.deb", "4.deb"}
            assert (await c.get("http://deb.test/pool/0.deb")).headers["x-cache"] == "HIT"
            assert (await c.get("http://deb.test/pool/1.deb")).headers["x-cache"] == "MISS"
        assert front.cache.store.evictions == 3
        assert len(list((tmp_path / "store" / "objects").glob("*.body"))) == 3
    # What is on disk survives a restart, still within the bound.
    reopened = PackageCache(tmp_path / "store", max_bytes=2000, metrics=None)
    assert reopened.store.size <= 2000 and len(reopened.store._lru) == 2
    await reopened.aclose()


async def test_concurrent_requests_for_one_url_fetch_it_once(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    https_upstream.set(WHEEL, os.urandom(3_000_000))
    async with harness(tmp_path, upstream_ca, https_upstream) as front:

        async def fetch(trial: str) -> httpx.Response:
            async with client(front, trial) as c:
                return await c.get(f"https://files.test{WHEEL}")

        for i in range(8):
            await front.port(f"t{i}")
        answers = await asyncio.gather(*(fetch(f"t{i}") for i in range(8)))
        assert {a.content for a in answers} == {https_upstream.routes[WHEEL].body}
        assert https_upstream.count(WHEEL) == 1
        assert front.cache._locks == {}  # nothing kept per URL once answered


async def test_only_package_hosts_https_is_terminated(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    """A program that pins its own root (the upstream's, as a public site's) reaches a
    host that is no package host exactly as without the cache: its tunnel is carried
    untouched, nothing is stored. A package host's HTTPS is terminated (the pinned
    client sees the cache's certificate and refuses it)."""
    https_upstream.set(WHEEL, b"W" * 5000)
    async with harness(tmp_path, upstream_ca, https_upstream) as front:
        pinned = ssl.create_default_context(cafile=str(upstream_ca.cert_path))
        port = await front.port("pinned")
        async with httpx.AsyncClient(
            proxy=f"http://127.0.0.1:{port}", verify=pinned, trust_env=False
        ) as c:
            got = await c.get(f"https://elsewhere.test{WHEEL}")
            assert got.status_code == 200 and got.content == b"W" * 5000
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await c.get(f"https://files.test{WHEEL}")
        assert front.cache.store.size == 0 and front.stats("pinned").requests == 0
        assert https_upstream.count(WHEEL) == 1


def test_package_hosts_and_the_operators_patterns() -> None:
    hosts = TlsHosts(["Mirror.Internal.Example", "*.pkg.example"])
    for name in (
        "pypi.org",
        "files.pythonhosted.org",
        "registry.npmjs.org",
        "deb.debian.org",
        "ftp.us.debian.org",
        "archive.ubuntu.com",
        "us.archive.ubuntu.com",
        "astral.sh",
        "github.com",
        "objects.githubusercontent.com",
        "mirror.internal.example",
        "a.pkg.example",
        "PYPI.ORG.",
    ):
        assert hosts.matches(name), name
    for name in (
        "example.com",
        "api.openai.com",
        "evilpypi.org",
        "pypi.org.evil.test",
        "salsa.debian.org",
    ):
        assert not hosts.matches(name), name
    for bad in ("https://pypi.example", "mirror:8443", "*", "", "a b"):
        with pytest.raises(ValueError, match="not a host name pattern"):
            PackageCacheConfig(tls_hosts=(bad,))


def test_the_system_store_name_is_openssls_hash() -> None:
    """``subject_hash`` is ``openssl x509 -hash``: the public roots' well-known names."""
    pems = re.findall(
        rb"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----",
        Path(certifi.where()).read_bytes(),
        re.S,
    )
    names = {}
    with warnings.catch_warnings():  # a few public roots have non-positive serials
        warnings.simplefilter("ignore")
        for pem in pems:
            cert = x509.load_pem_x509_certificate(pem)
            names[cert.subject.rfc4514_string()] = subject_hash(cert)
    assert names["CN=ISRG Root X1,O=Internet Security Research Group,C=US"] == "4042bcee"
    assert names["CN=DigiCert Global Root G2,OU=www.digicert.com,O=DigiCert Inc,C=US"] == (
        "607986c7"
    )


def test_the_trust_dir_replaces_what_an_engine_left_in_a_files_place(tmp_path: Path) -> None:
    """An engine that bind-mounted ``ca.pem`` before it existed on the host made it a
    directory there (a service in a container that did not share its cache dir yet):
    the next start writes the file in its place."""
    (tmp_path / "package-cache-trust" / "ca.pem").mkdir(parents=True)
    service = PackageCacheService(PackageCacheConfig(root=tmp_path))
    try:
        assert (service.trust_dir / "ca.pem").read_bytes() == service.ca.cert_pem
    finally:
        service.close()


def test_processes_sharing_a_cache_dir_each_hold_a_store(tmp_path: Path) -> None:
    """Two services on one root at once (two harbor-exec processes): each its own
    store, one CA; the first store is free again when its holder ends."""
    config = PackageCacheConfig(root=tmp_path, max_bytes=10_000_000)
    first = PackageCacheService(config)
    second = PackageCacheService(config)
    try:
        assert first.slot.path == tmp_path / "package-cache"
        assert second.slot.path == tmp_path / "package-cache-2"
        assert first.ca.cert_pem == second.ca.cert_pem
    finally:
        first.close()
        second.close()
    third = PackageCacheService(config)
    try:
        assert third.slot.path == tmp_path / "package-cache"
    finally:
        third.close()


def test_processes_starting_at_once_make_one_ca(tmp_path: Path) -> None:
    script = (
        "import sys, time; from pathlib import Path\n"
        "from harbor_exec.network.packages.ca import LocalCA\n"
        "while time.time() < float(sys.argv[2]): pass\n"
        "print(LocalCA(Path(sys.argv[1])).cert_pem.decode())\n"
    )
    start = str(time.time() + 1.5)
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / "ca"), start],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = {run.communicate(timeout=60)[0] for run in runs}
    assert len(outputs) == 1 and "BEGIN CERTIFICATE" in outputs.pop()
    assert (tmp_path / "ca" / "ca-cert.pem").read_bytes() == LocalCA(tmp_path / "ca").cert_pem


def test_the_default_bound_is_a_share_of_the_disk(tmp_path: Path) -> None:
    total = shutil.disk_usage(tmp_path).total
    expected = max(256 * 1024**2, min(20 * 1024**3, int(total * 0.10)))
    assert default_max_bytes(tmp_path / "not" / "yet") == expected
    service = PackageCacheService(PackageCacheConfig(root=tmp_path))
    try:
        assert service.cache.store.max_bytes == expected
    finally:
        service.close()


async def test_upstream_tls_is_verified(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    https_upstream.set(WHEEL, b"from an unverified host")
    other = LocalCA(tmp_path / "not-the-upstreams-ca")
    async with harness(tmp_path, upstream_ca, https_upstream, ca_bundle=other.cert_path) as front:
        async with client(front) as c:
            got = await c.get(f"https://files.test{WHEEL}")
        assert got.status_code == 502 and b"CERTIFICATE_VERIFY_FAILED" in got.content
        assert front.cache.store.size == 0 and front.stats().upstream_errors == 1


async def test_a_non_public_destination_is_refused_by_the_cache(
    tmp_path: Path, upstream_ca: LocalCA, http_upstream: Upstream
) -> None:
    async with harness(tmp_path, upstream_ca, http_upstream) as front:
        async with client(front) as c:
            got = await c.get("http://10.1.2.3/pool/x.deb")
        assert got.status_code == 403 and b"not public" in got.content
        assert front.stats().upstream_requests == 0 and front.cache.store.size == 0


def test_the_ca_key_is_private_and_leaves_verify(tmp_path: Path) -> None:
    ca = LocalCA(tmp_path / "ca")
    key = tmp_path / "ca" / CA_KEY
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "ca").stat().st_mode) == 0o700
    assert b"PRIVATE KEY" not in ca.cert_pem and b"PRIVATE KEY" not in ca.cert_path.read_bytes()
    # No leaf key or leaf file is left behind.
    assert sorted(p.name for p in (tmp_path / "ca").iterdir()) == ["ca-cert.pem", "ca-key.pem"]
    ca.server_context("pypi.org")
    assert sorted(p.name for p in (tmp_path / "ca").iterdir()) == ["ca-cert.pem", "ca-key.pem"]
    # The same CA is loaded again; a key others can read is refused.
    assert LocalCA(tmp_path / "ca").cert_pem == ca.cert_pem
    os.chmod(key, 0o644)
    with pytest.raises(PermissionError, match="0600"):
        LocalCA(tmp_path / "ca")


@pytest.mark.parametrize(
    ("host", "path", "kind"),
    [
        ("deb.debian.org", "/debian/dists/bookworm/InRelease", Kind.INDEX),
        ("deb.debian.org", "/debian/dists/bookworm/main/binary-amd64/Packages.xz", Kind.INDEX),
        (
            "deb.debian.org",
            "/debian/dists/bookworm/main/binary-amd64/by-hash/SHA256/ab",
            Kind.ARTIFACT,
        ),
        ("deb.debian.org", "/debian/pool/main/c/curl/curl_7.88.1-10_amd64.deb", Kind.ARTIFACT),
        ("pypi.org", "/simple/pytest/", Kind.INDEX),
        ("pypi.org", "/pypi/pytest/json", Kind.INDEX),
        ("files.pythonhosted.org", "/packages/ab/cd/pytest-8.4.1-py3-none-any.whl", Kind.ARTIFACT),
        ("registry.npmjs.org", "/left-pad", Kind.INDEX),
        ("registry.npmjs.org", "/left-pad/-/left-pad-1.3.0.tgz", Kind.ARTIFACT),
        ("astral.sh", "/uv/0.8.0/install.sh", Kind.OTHER),
    ],
)
def test_classification(host: str, path: str, kind: Kind) -> None:
    assert classify(host, path) is kind


def test_the_service_serves_trials_on_their_own_proxy_loops(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream, http_upstream: Upstream
) -> None:
    """The server's shape: one cache on its loop, each trial's proxy on another."""
    https_upstream.set(WHEEL, b"W" * 200_000)
    http_upstream.set("/debian/pool/main/c/curl.deb", b"D" * 5000)
    service = PackageCacheService(
        PackageCacheConfig(
            root=tmp_path / "cache",
            upstream_ca_bundle=upstream_ca.cert_path,
            tls_hosts=TEST_TLS_HOSTS,
        )
    )
    overrides = {"files.test": ("127.0.0.1", https_upstream.port)}
    overrides["deb.test:80"] = ("127.0.0.1", http_upstream.port)
    try:
        # The trust directory holds public material only; the key stays in the CA's.
        trust = sorted(p.name for p in service.trust_dir.iterdir())
        assert trust == ["apt.conf", "ca-bundle.pem", "ca.pem"]
        for name in trust:
            assert b"PRIVATE" not in (service.trust_dir / name).read_bytes()
        assert service.ca.directory != service.trust_dir
        results: list[tuple[bytes, bytes, int]] = []
        stats: list[dict[str, int]] = []
        for trial in ("t1", "t2"):
            session = service.session()
            proxy = EgressProxy(
                directory=tmp_path / f"e-{trial}",
                trial=trial,
                overrides=overrides,
                dns=False,
                upstream=service.upstream(session),
            )
            thread = EgressProxyThread(proxy)
            thread.start()
            thread.set_phase("verifier", EgressPolicy(EgressMode.PUBLIC))
            forwarder = ForwarderThread(str(proxy.socket_path))
            port = forwarder.start()
            try:
                with httpx.Client(
                    proxy=f"http://127.0.0.1:{port}",
                    verify=ssl.create_default_context(
                        cafile=str(service.trust_dir / "ca-bundle.pem")
                    ),
                    trust_env=False,
                ) as c:
                    wheel = c.get(f"https://files.test{WHEEL}")
                    deb = c.get("http://deb.test/debian/pool/main/c/curl.deb")
                    posted = c.post(f"https://files.test{WHEEL}", content=b"x" * 10)
                results.append((wheel.content, deb.content, posted.status_code))
            finally:
                forwarder.close()
                thread.close()
            session.write(tmp_path / f"{trial}.json")
            stats.append(session.stats.to_dict())
        assert results[0][:2] == results[1][:2] == (b"W" * 200_000, b"D" * 5000)
        assert results[0][2] == results[1][2] == 200
        # The service's own totals (what a Ray node reports) are its sessions' sums.
        totals = service.cache.totals()
        for key in ("requests", "hits", "misses", "passthrough", "bytes_from_upstream"):
            assert getattr(totals, key) == sum(s[key] for s in stats), key
        assert totals.stored_entries == 2 and totals.stored_bytes >= 205_000
        first, second = stats
        assert (first["misses"], first["passthrough"]) == (2, 1)
        assert first["bytes_from_upstream"] == 205_000 + 200_000
        assert (second["hits"], second["misses"], second["passthrough"]) == (2, 0, 1)
        assert second["bytes_from_cache"] == 205_000
        # One GET filled the cache; each POST passed through.
        assert https_upstream.count(WHEEL) == 3
        assert json.loads((tmp_path / "t2.json").read_text())["hits"] == 2
    finally:
        service.close()


def test_server_metrics_show_the_package_cache() -> None:
    from harbor_exec.network.packages.cache import CACHE_METRICS, SERVER_NODE
    from harbor_exec.server.metrics import ServerMetrics

    before = int(CACHE_METRICS.value(SERVER_NODE, "hits"))
    CACHE_METRICS.count(SERVER_NODE, hits=3)
    text = ServerMetrics().render({})
    assert f'harbor_exec_package_cache_hits_total{{node="server"}} {float(before + 3)}' in text
    assert 'harbor_exec_package_cache_bytes_total{node="server",source="cache"}' in text
    assert "harbor_exec_package_cache_bound_bytes" in text


def test_the_cache_is_on_by_default_in_every_entry_point(tmp_path: Path) -> None:
    """validate, run, serve and prewarm take the same options, on unless told not to;
    ``HarborBackend``'s configuration too (``package_cache=False`` turns it off)."""
    import typer
    from typer.testing import CliRunner

    from harbor_exec.backends.harbor.constructor import harbor_config
    from harbor_exec.cli.app import app
    from harbor_exec.cli.options import package_cache_config
    from harbor_exec.cli.serve import ServeOptions

    group = typer.main.get_group(app)
    for name in ("validate", "run", "serve", "prewarm"):
        params = {p.name: p for p in group.commands[name].params}
        assert params["package_cache"].default is True, name
        assert params["package_cache"].opts == ["--package-cache"], name
        assert params["package_cache"].secondary_opts == ["--no-package-cache"], name
        shown = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "240"}).output
        assert "--package-cache-max-gb" in shown and "--package-cache-host" in shown, name
    values = {
        "package_cache": True,
        "package_cache_max_gb": None,
        "package_cache_dir": None,
        "package_cache_host": None,
    }
    assert package_cache_config(values) == PackageCacheConfig()
    assert package_cache_config({**values, "package_cache": False}) is None
    assert package_cache_config(
        {**values, "package_cache_max_gb": 0.5, "package_cache_dir": tmp_path}
    ) == PackageCacheConfig(root=tmp_path, max_bytes=512 * 1024**2)
    with pytest.raises(typer.BadParameter, match="not a host name pattern"):
        package_cache_config({**values, "package_cache_host": ["https://x.example"]})
    assert ServeOptions().package_cache == PackageCacheConfig()
    assert harbor_config(tasks_dir=str(tmp_path)).package_cache == PackageCacheConfig()
    for off in (False, None):
        assert harbor_config(tasks_dir=str(tmp_path), package_cache=off).package_cache is None
    assert (
        "--run-verifier"
        in CliRunner().invoke(app, ["prewarm", "--help"], env={"COLUMNS": "240"}).output
    )


def _hits(text: str, node: str) -> float:
    prefix = f'harbor_exec_package_cache_hits_total{{node="{node}"}} '
    [line] = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(line.removeprefix(prefix))


def test_node_cache_reports_count_once_by_node_in_server_metrics() -> None:
    """Ray nodes' cumulative reports: the latest of each actor counts, a repeated or
    late one changes nothing, a restarted actor adds to its node, nodes stay apart."""
    from harbor_exec.executors.ray.driver import _count_node_cache
    from harbor_exec.network.packages.cache import (
        NODE_CACHE_TOTALS,
        CacheTotals,
        NodeCacheReport,
    )
    from harbor_exec.server.metrics import ServerMetrics

    def report(node: str, run: str, seq: int, hits: int) -> NodeCacheReport:
        # What is stored grows with the hits here: a gauge, its current actor's value.
        totals = CacheTotals(hits=hits, bytes_from_cache=hits * 10, stored_bytes=hits * 100)
        return NodeCacheReport(node, run, seq, totals)

    node = f"t-{os.getpid()}"
    try:
        for one in (
            report(node, "a", 1, 2),
            report(node, "a", 3, 5),
            report(node, "a", 2, 4),  # arrived late: older than seq 3
            report(node, "a", 3, 5),  # the same report twice
            report(node, "b", 1, 1),  # the node's actor restarted
            report(f"{node}-2", "c", 1, 7),
        ):
            _count_node_cache(one)
        _count_node_cache(None)  # a node without a cache reports nothing
        text = ServerMetrics().render({})
        assert _hits(text, node) == 6.0
        assert _hits(text, f"{node}-2") == 7.0
        assert f'harbor_exec_package_cache_bytes_total{{node="{node}",source="cache"}} 60.0' in text
        # The restarted actor ("b") finds the same store: its figure, not a sum (600).
        assert f'harbor_exec_package_cache_stored_bytes{{node="{node}"}} 100.0' in text
        # A late report of the actor before changes what is current no more.
        _count_node_cache(report(node, "a", 4, 9))
        text = ServerMetrics().render({})
        assert _hits(text, node) == 10.0
        assert f'harbor_exec_package_cache_stored_bytes{{node="{node}"}} 100.0' in text
    finally:
        NODE_CACHE_TOTALS.forget(node)
        NODE_CACHE_TOTALS.forget(f"{node}-2")


def test_a_node_reports_its_own_service_totals(tmp_path: Path) -> None:
    from harbor_exec.executors.ray.node import NodePackageCache

    node = NodePackageCache("w7")
    assert node.report() is None  # no service until work that wants one
    node.get(PackageCacheConfig(root=tmp_path, max_bytes=123_456))
    try:
        first, second = node.report(), node.report()
        assert first is not None and second is not None
        assert first.node == second.node == "w7"
        assert first.incarnation == second.incarnation
        assert second.seq > first.seq
        assert first.totals.bound_bytes == 123_456 and first.totals.requests == 0
        assert NodePackageCache("w7").report() is None  # another actor: its own count
    finally:
        node.close()


async def test_a_fill_whose_last_reader_left_stops(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    """A client that starts a slow download and hangs up leaves no fill behind holding an
    upstream connection (nor one of its trial's slots); nothing half-read is stored."""
    https_upstream.set(WHEEL, os.urandom(400_000))
    https_upstream.bytes_per_sec = 40_000  # ten seconds for the whole body
    async with harness(tmp_path, upstream_ca, https_upstream) as front:
        async with (
            client(front, "t1") as c1,
            c1.stream("GET", f"https://files.test{WHEEL}") as response,
        ):
            async for _chunk in response.aiter_raw():
                break  # the first bytes, then hang up
        cache = front.cache
        for _ in range(100):  # bounded: well under the body's ten seconds
            if not cache._fills:
                break
            await asyncio.sleep(0.05)
        assert cache._fills == {}
        assert cache.store.get(next(iter(cache.store._lru), "")) is None
        assert front.stats("t1").upstream_requests == 1
        assert front.trials["t1"][3].upstream_slots._value == cache_module.PER_TRIAL_UPSTREAM


async def test_a_trial_holds_at_most_its_share_of_the_upstream(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    """One trial's slow fills wait for its own slots; another trial's request goes out at
    once (the shared pool is never all one trial's). Ordered by events: the victim is
    answered while the attacker's share is still all taken."""
    for i in range(cache_module.PER_TRIAL_UPSTREAM + 1):
        # About a hundred seconds each: they are still running when the victim is done.
        https_upstream.set(f"/packages/slow-{i}.whl", os.urandom(200_000), bytes_per_sec=2_000)
    https_upstream.set(WHEEL, b"victim")
    async with harness(tmp_path, upstream_ca, https_upstream) as front:
        async with client(front, "attacker") as attacker, client(front, "victim") as victim:
            hogs = [
                asyncio.create_task(attacker.get(f"https://files.test/packages/slow-{i}.whl"))
                for i in range(cache_module.PER_TRIAL_UPSTREAM + 1)
            ]
            slots = front.trials["attacker"][3].upstream_slots
            for _ in range(500):  # bounded: the hogs' first requests reach the cache
                if slots.locked():
                    break
                await asyncio.sleep(0.01)
            assert slots.locked()  # the attacker's share is taken...
            answer = await victim.get(f"https://files.test{WHEEL}")
            assert answer.content == b"victim"
            assert slots.locked()  # ...and still is: the victim did not wait for it
            assert not any(hog.done() for hog in hogs)
            for hog in hogs:  # the attacker hangs up: its fills end with their readers
                hog.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)
        for _ in range(500):
            if slots._value == cache_module.PER_TRIAL_UPSTREAM and not front.cache._fills:
                break
            await asyncio.sleep(0.01)
        assert slots._value == cache_module.PER_TRIAL_UPSTREAM  # every slot given back


async def test_a_dripping_upstream_ends_its_fill(
    tmp_path: Path,
    upstream_ca: LocalCA,
    https_upstream: Upstream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An upstream that sends a few bytes a second holds its fill only for the grace."""
    monkeypatch.setattr(cache_module, "FILL_GRACE_SEC", 0.5)
    https_upstream.set(WHEEL, os.urandom(20_000))
    https_upstream.bytes_per_sec = 2_000  # ten seconds, far under the minimum rate
    async with harness(tmp_path, upstream_ca, https_upstream) as front:
        async with client(front, "t1") as c1:
            started = time.monotonic()
            with pytest.raises(httpx.HTTPError):
                response = await c1.get(f"https://files.test{WHEEL}")
                response.raise_for_status()
                assert len(response.content) < 20_000
                raise httpx.RemoteProtocolError("cut short")
            assert time.monotonic() - started < 5
        assert front.cache._fills == {}
        assert front.stats("t1").upstream_errors == 1  # the trial's record says so


async def test_a_burst_of_fills_keeps_the_bound_and_anothers_entries(
    tmp_path: Path, upstream_ca: LocalCA, http_upstream: Upstream
) -> None:
    """A neighbour's burst of large fills, all in flight at once, never takes the store
    past its bound (reserved before written), and evicts only its own: the victim's
    entries, within its share, stay; what does not fit is served through, whole."""
    for i in range(3):
        http_upstream.set(f"/pool/victim-{i}.deb", bytes([65 + i]) * 1000)
    for i in range(8):
        http_upstream.set(f"/pool/burst-{i}.deb", bytes([97 + i]) * 3000)
    http_upstream.bytes_per_sec = 30_000  # each burst body takes 0.1 s: all in flight at once
    async with harness(tmp_path, upstream_ca, http_upstream, max_bytes=10_000) as front:
        await front.port("victim", front.cache.session(task="victim"))
        await front.port("attacker", front.cache.session(task="attacker"))
        store = front.cache.store
        async with client(front, "victim") as victim:
            for i in range(3):
                await victim.get(f"http://deb.test/pool/victim-{i}.deb")
        victims = set(store._lru)
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, store.size + store.in_flight)
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        async with client(front, "attacker") as attacker:
            answers = await asyncio.gather(
                *(attacker.get(f"http://deb.test/pool/burst-{i}.deb") for i in range(8))
            )
        watcher.cancel()
        assert [a.content for a in answers] == [bytes([97 + i]) * 3000 for i in range(8)]
        assert peak <= 10_000 and store.size <= 10_000
        assert victims <= set(store._lru)  # the victim's entries stay
        assert front.stats("attacker").passthrough > 0  # past its share: served through
        assert store.in_flight == 0
        async with client(front, "victim") as victim:
            again = await victim.get("http://deb.test/pool/victim-0.deb")
            assert again.headers["x-cache"] == "HIT"


def test_the_store_makes_room_from_owners_over_their_share(tmp_path: Path) -> None:
    """Room for an owner within its share comes from the least recently used entry of an
    owner over its share; an owner past its share evicts only its own."""
    from harbor_exec.network.packages.cache import CacheStore, Entry

    store = CacheStore(tmp_path, max_bytes=1000)

    def put(owner: str, name: str, size: int) -> bool:
        temp = store.temp_path()
        temp.write_bytes(b"x" * size)
        entry = Entry(name, "", "artifact", size, [], 0.0, 0.0, owner=owner)
        return store.put(name, entry, temp)

    assert put("a", "a1", 200) and put("b", "b1", 400) and put("b", "b2", 400)
    # "b" holds 800 of 1000 with two owners (a share of 500): "a", within its share,
    # evicts b's oldest, not its own older entry.
    assert put("a", "a2", 200)
    assert set(store._lru) == {"a1", "b1", "b2", "a2"} - {"b1"}
    # "b" past its share for 400 more: only its own goes.
    assert put("b", "b3", 400)
    assert set(store._lru) == {"a1", "a2", "b3"}
    # More than "b" may hold while "a" holds its share: not stored, nothing evicted.
    assert not put("b", "b4", 700)
    assert set(store._lru) == {"a1", "a2", "b3"}
    assert store.size == 800 and store.in_flight == 0
    # Reservations count before any byte is written.
    assert store.reserve("c", 100)
    assert not store.reserve("c", 300)  # three owners: a share of 333
    store.release("c", 100)
    assert store.in_flight == 0


async def test_the_fills_a_trial_started_and_nobody_reads_end_with_it(
    tmp_path: Path, upstream_ca: LocalCA, https_upstream: Upstream
) -> None:
    """An answer never sent (its client gone before the body) leaves a fill nobody reads:
    the trial's end stops it, and gives back its upstream slot and store reservation."""
    from harbor_exec.network.packages.cache import CacheRequest

    https_upstream.set(WHEEL, os.urandom(200_000))
    https_upstream.bytes_per_sec = 20_000  # ten seconds
    async with harness(tmp_path, upstream_ca, https_upstream) as front:
        cache = front.cache
        session = cache.session(task="gone")
        resolve = connector_resolver(Connector(front.overrides, dns=False))
        request = CacheRequest("GET", "https", "files.test", 443, WHEEL, resolve=resolve)
        answer = await cache.handle(request, session)
        assert answer.source == "miss" and len(cache._fills) == 1
        await answer.aclose()  # never read
        fill = next(iter(cache._fills.values()))
        session.finish()
        assert fill.task is not None
        await asyncio.wait([fill.task], timeout=5)  # its ten seconds cut short
        assert fill.done and isinstance(fill.error, asyncio.CancelledError)
        assert cache._fills == {} and cache.store.in_flight == 0
        assert session.upstream_slots._value == cache_module.PER_TRIAL_UPSTREAM
