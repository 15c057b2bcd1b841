"""The allowlist egress proxy (harbor_exec.network.egress), on loopback only.

Clients reach the proxy as a container does: through the runtime's forwarder
(a loopback TCP port piped to the proxy's unix socket), with the standard proxy
settings. Allowed names resolve, through the proxy's override map, to local
servers on 127.0.0.1; nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import datetime
import http.server
import ipaddress
import json
import socket
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from harbor_exec.container.forward import ForwarderThread
from harbor_exec.network.egress.policy import (
    EgressMode,
    EgressPolicy,
    is_forbidden_address,
    normalize_allowed_hosts,
)
from harbor_exec.network.egress.proxy import (
    EgressContext,
    EgressLimits,
    EgressProxy,
    EgressProxyThread,
    HttpRequest,
    HttpResponse,
)
from harbor_exec.sandbox.cgroups import Companion

# --------------------------------------------------------------------------- servers


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:
        self.server.seen.append((self.command, self.path, self.headers.get("Host", "")))
        size = int(self.path.rsplit("/", 1)[-1]) if self.path.startswith("/bytes/") else 0
        body = b"x" * size if size else f"hello from {self.server.label}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        data = self.rfile.read(length)
        self.server.seen.append((self.command, self.path, self.headers.get("Host", "")))
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[::-1])

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, label: str, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.label = label
        self.seen: list[tuple[str, str, str]] = []
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)

    @property
    def port(self) -> int:
        return int(self.server_address[1])


@pytest.fixture
def web() -> Iterator[_Server]:
    server = _Server("allowed")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@dataclass
class _Cert:
    server: ssl.SSLContext
    client: ssl.SSLContext
    ca_file: Path


def _cert(tmp: Path, name: str) -> _Cert:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp / f"{name}.pem", tmp / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_file, key_file)
    client = ssl.create_default_context(cafile=str(cert_file))
    return _Cert(server, client, cert_file)


# --------------------------------------------------------------------------- proxy


@dataclass
class _Setup:
    thread: EgressProxyThread
    forwarder: ForwarderThread
    port: int
    log: Path
    closers: list[Any] = field(default_factory=list)

    @property
    def proxy(self) -> EgressProxy:
        return self.thread.proxy

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def refusals(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        with httpx.Client(proxy=self.url, trust_env=False, timeout=10, **kwargs) as client:
            return client.get(url)


@pytest.fixture
def make_proxy(tmp_path: Path) -> Iterator[Any]:
    made: list[_Setup] = []

    def make(
        policy: EgressPolicy,
        overrides: dict[str, tuple[str, int]] | None = None,
        *,
        limits: EgressLimits | None = None,
        dns: bool = False,
        **kwargs: Any,
    ) -> _Setup:
        directory = tmp_path / f"egress{len(made)}"
        log = tmp_path / f"refused{len(made)}.jsonl"
        proxy = EgressProxy(
            directory=directory,
            trial="trial-1",
            refused_log=log,
            limits=limits or EgressLimits(),
            overrides=overrides,
            dns=dns,
            **kwargs,
        )
        thread = EgressProxyThread(proxy)
        thread.start()
        thread.set_phase("agent", policy)
        forwarder = ForwarderThread(str(proxy.socket_path))
        setup = _Setup(thread, forwarder, forwarder.start(), log)
        made.append(setup)
        return setup

    yield make
    for setup in made:
        setup.forwarder.close()
        setup.thread.close()
        assert not setup.proxy.socket_path.exists()


# --------------------------------------------------------------------------- policy


def test_policy_matches_harbor_entry_forms() -> None:
    policy = EgressPolicy.allowlist(
        "Example.COM.", "*.pythonhosted.org", "192.0.2.7", "198.51.100.0/24", "2001:db8::/32"
    )
    assert policy.allowed_hosts == (
        "example.com",
        "*.pythonhosted.org",
        "192.0.2.7",
        "198.51.100.0/24",
        "2001:db8::/32",
    )
    allowed = ["example.com", "EXAMPLE.com.", "files.pythonhosted.org", "a.b.pythonhosted.org"]
    allowed += ["192.0.2.7", "198.51.100.200", "[2001:db8::5]", "2001:DB8:0::6"]
    refused = ["www.example.com", "pythonhosted.org", "example.com.evil.test", "192.0.2.8"]
    refused += ["evilpythonhosted.org", "2001:db9::1", ""]
    assert [h for h in allowed if not policy.allows(h)] == []
    assert [h for h in refused if policy.allows(h)] == []
    assert EgressPolicy(EgressMode.PUBLIC).allows("anything.test")
    assert not EgressPolicy(EgressMode.NO_NETWORK).allows("example.com")
    assert not EgressPolicy.allowlist().allows("example.com")


@pytest.mark.parametrize(
    "entry",
    [
        "example.com",
        " Example.com. ",
        "*.example.com",
        "10.0.0.0/8",
        "10.0.0.1/8",
        "::1",
        "[::1]",
        "https://example.com",
        "example.com:443",
        "ex*ample.com",
        "*.",
        "*.1.2.3.4",
        "-bad-.com",
        "",
        "a_b.com",
        "fe80::1%eth0",
    ],
)
def test_normalisation_and_errors_as_harbor(entry: str) -> None:
    from harbor.models.task.config import normalize_allowed_hosts as harbor_normalize

    try:
        theirs: list[str] | None = harbor_normalize([entry])
    except ValueError:
        theirs = None
    try:
        ours: list[str] | None = normalize_allowed_hosts([entry])
    except ValueError as exc:
        assert repr(entry.strip().lower())[1:-1][:3] in str(exc) or "non-empty" in str(exc)
        ours = None
    assert ours == theirs


def test_forbidden_addresses() -> None:
    for address in [
        "127.0.0.1",
        "127.9.9.9",
        "0.0.0.0",
        "10.1.2.3",
        "172.17.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "224.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "2002:7f00:1::",
        # Translations of private IPv4 (a NAT64 host reaches 10.0.0.1 through them) and
        # ranges refused whatever they embed (IPv4-compatible, SIIT, local-use NAT64,
        # site-local).
        "64:ff9b::a00:1",
        "64:ff9b::7f00:1",
        "64:ff9b::a9fe:a9fe",
        "64:ff9b:1::a00:1",
        "64:ff9b:1:ffff::808:808",
        "::10.0.0.1",
        "::8.8.8.8",
        "::ffff:0:10.0.0.1",
        "::ffff:0:8.8.8.8",
        "fec0::1",
        "feff::1",
        "not-an-address",
    ]:
        assert is_forbidden_address(address), address
    # A public IPv4 address stays public through the well-known NAT64 prefix.
    for address in ["93.184.215.14", "2606:4700::1111", "1.1.1.1", "64:ff9b::101:101"]:
        assert not is_forbidden_address(address), address
    assert ipaddress.ip_address("93.184.215.14").is_global


# --------------------------------------------------------------------------- proxying


def test_allowed_host_is_reached_through_the_override(make_proxy: Any, web: _Server) -> None:
    setup = make_proxy(
        EgressPolicy.allowlist("allowed.test"), {"allowed.test": ("127.0.0.1", web.port)}
    )
    response = setup.get("http://allowed.test/hello?x=1")
    assert response.status_code == 200
    assert response.text == "hello from allowed"
    # Host comes from the URL; the path and query arrive in origin form.
    assert web.seen == [("GET", "/hello?x=1", "allowed.test")]
    # urllib with the standard proxy settings, as programs in the container use them.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": setup.url}))
    with opener.open("http://allowed.test/again", timeout=10) as answer:
        assert answer.read() == b"hello from allowed"
    # A body goes up and the answer comes back (keep-alive on one connection).
    with httpx.Client(proxy=setup.url, trust_env=False, timeout=10) as client:
        for _ in range(3):
            posted = client.post("http://allowed.test/echo", content=b"abc" * 1000)
            assert posted.content == b"cba" * 1000
    assert setup.refusals() == []
    assert setup.proxy.stats.requests == 5


def test_other_host_gets_403_logged_without_resolving(make_proxy: Any, web: _Server) -> None:
    setup = make_proxy(
        EgressPolicy.allowlist("allowed.test"), {"allowed.test": ("127.0.0.1", web.port)}
    )
    resolved: list[str] = []
    original = setup.proxy.connector.resolve

    async def spy(host: str, port: int) -> list[tuple[str, int]]:
        resolved.append(host)
        found: list[tuple[str, int]] = await original(host, port)
        return found

    setup.proxy.connector.resolve = spy
    response = setup.get("http://other.test:8080/secret")
    assert response.status_code == 403
    assert "other.test:8080 refused" in response.text
    with pytest.raises(httpx.ProxyError, match="403"):
        setup.get("https://elsewhere.test/")
    assert resolved == []
    assert web.seen == []
    records = setup.refusals()
    assert [(r["method"], r["host"], r["port"], r["phase"], r["trial"]) for r in records] == [
        ("GET", "other.test", 8080, "agent", "trial-1"),
        ("CONNECT", "elsewhere.test", 443, "agent", "trial-1"),
    ]
    assert all("allowed_hosts" in r["reason"] and r["time"].endswith("+00:00") for r in records)


def test_connect_passes_tls_through(make_proxy: Any, tmp_path: Path) -> None:
    cert = _cert(tmp_path, "secure.test")
    server = _Server("tls", tls=cert.server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        setup = make_proxy(
            EgressPolicy.allowlist("secure.test"), {"secure.test:443": ("127.0.0.1", server.port)}
        )
        # The client verifies the server's own certificate for its own name: the proxy
        # has no key, so the bytes went through untouched.
        response = setup.get("https://secure.test/tls", verify=cert.client)
        assert response.status_code == 200 and response.text == "hello from tls"
        assert server.seen == [("GET", "/tls", "secure.test")]
        assert setup.proxy.stats.tunnels == 1
        # A raw socket speaking CONNECT itself, as any program may.
        with socket.create_connection(("127.0.0.1", setup.port), timeout=10) as raw:
            raw.sendall(b"CONNECT secure.test:443 HTTP/1.1\r\nHost: secure.test:443\r\n\r\n")
            head = raw.recv(4096)
            assert head.startswith(b"HTTP/1.1 200 ")
            with cert.client.wrap_socket(raw, server_hostname="secure.test") as tls:
                tls.sendall(b"GET /raw HTTP/1.1\r\nHost: secure.test\r\nConnection: close\r\n\r\n")
                answer = b""
                while chunk := tls.recv(4096):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello from tls")
        # Another port of an allowed name is admitted (Harbor's policies ignore ports),
        # but only the override's port is mapped, and DNS is off in tests.
        with socket.create_connection(("127.0.0.1", setup.port), timeout=10) as raw:
            raw.sendall(b"CONNECT secure.test:9 HTTP/1.1\r\nHost: secure.test:9\r\n\r\n")
            assert raw.recv(4096).startswith(b"HTTP/1.1 403 ")
        assert "DNS is off" in setup.refusals()[-1]["reason"]
    finally:
        server.shutdown()
        server.server_close()


def test_ssrf_guard_refuses_host_addresses(make_proxy: Any, web: _Server) -> None:
    # Public mode, no override: the proxy is a host service facing a hostile agent.
    # (DNS on: "localhost" resolves from /etc/hosts; nothing else is looked up.)
    setup = make_proxy(EgressPolicy(EgressMode.PUBLIC), dns=True)
    for url in (
        f"http://127.0.0.1:{web.port}/",
        f"http://localhost:{web.port}/",
        f"http://[::1]:{web.port}/",
        f"http://[::ffff:127.0.0.1]:{web.port}/",
        "http://0.0.0.0/",
    ):
        # Raw requests: httpx writes an IPv6 absolute-form target without brackets.
        with socket.create_connection(("127.0.0.1", setup.port), timeout=10) as raw:
            raw.sendall(f"GET {url} HTTP/1.1\r\nHost: h\r\n\r\n".encode())
            answer = raw.recv(4096)
        assert answer.startswith(b"HTTP/1.1 403 "), url
        assert b"not public" in answer, url
    with socket.create_connection(("127.0.0.1", setup.port), timeout=10) as raw:
        raw.sendall(f"CONNECT 127.0.0.1:{web.port} HTTP/1.1\r\nHost: h\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 403 ")
    assert web.seen == []
    assert len(setup.refusals()) == 6
    # An allowlisted private address is refused all the same (only overrides reach the host).
    allow = make_proxy(EgressPolicy.allowlist("127.0.0.1"))
    assert allow.get(f"http://127.0.0.1:{web.port}/").status_code == 403
    assert web.seen == []


def test_origin_form_and_malformed_requests_are_400(make_proxy: Any) -> None:
    setup = make_proxy(EgressPolicy(EgressMode.PUBLIC))
    for request in (
        b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
        b"GET https://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
        b"GET http://user@allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
        b"CONNECT allowed.test HTTP/1.1\r\nHost: h\r\n\r\n",
        # Anything but host and port in a CONNECT target (a fragment, a user, a path).
        b"CONNECT allowed.test:443#evil.test HTTP/1.1\r\nHost: h\r\n\r\n",
        b"CONNECT allowed.test:443/evil.test HTTP/1.1\r\nHost: h\r\n\r\n",
        b"CONNECT evil.test@allowed.test:443 HTTP/1.1\r\nHost: h\r\n\r\n",
        b"CONNECT allowed.test:443?evil.test HTTP/1.1\r\nHost: h\r\n\r\n",
        b"CONNECT allowed.test:0 HTTP/1.1\r\nHost: h\r\n\r\n",
        b"CONNECT allowed.test:70000 HTTP/1.1\r\nHost: h\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", setup.port), timeout=10) as raw:
            raw.sendall(request)
            assert raw.recv(4096).startswith(b"HTTP/1.1 400 "), request


def test_refusal_log_is_bounded_under_a_flood(make_proxy: Any) -> None:
    setup = make_proxy(
        EgressPolicy.allowlist("allowed.test"), limits=EgressLimits(max_log_records=5)
    )
    with httpx.Client(proxy=setup.url, trust_env=False, timeout=10) as client:
        for i in range(40):
            assert client.get(f"http://flood{i}.test/" + "a" * 5000).status_code == 403
    records = setup.refusals()
    assert len(records) == 6
    assert [r["host"] for r in records[:5]] == [f"flood{i}.test" for i in range(5)]
    assert "counted, not logged" in records[5]["note"]
    assert setup.proxy.stats.refused == 40
    # A long name is cut in the log.
    assert setup.log.stat().st_size < 4000


def test_byte_budget_and_connection_limits(make_proxy: Any, web: _Server) -> None:
    overrides = {"allowed.test": ("127.0.0.1", web.port)}
    setup = make_proxy(
        EgressPolicy.allowlist("allowed.test"),
        overrides,
        limits=EgressLimits(max_bytes=100_000, max_connections=4, max_upstream_connections=50),
    )
    assert setup.get("http://allowed.test/bytes/50000").content == b"x" * 50000
    with pytest.raises(httpx.HTTPError):
        setup.get("http://allowed.test/bytes/80000")  # cut mid-answer
    refused = setup.get("http://allowed.test/bytes/10")
    assert refused.status_code == 403 and "egress bytes are used up" in refused.text

    # Client connections at once: the fifth is closed without an answer (once the
    # connections above have closed: a refused one lingers for its client's close).
    def open_connections(count: int) -> bool:
        for _ in range(400):
            if setup.proxy.open_connections == count:
                return True
            threading.Event().wait(0.025)
        return False

    assert open_connections(0)
    sockets = [socket.socket(socket.AF_UNIX) for _ in range(5)]
    try:
        for sock in sockets[:4]:
            sock.connect(str(setup.proxy.socket_path))
            sock.sendall(b"GET http://allowed.test/")  # incomplete: the connection stays open
        assert open_connections(4)
        sockets[4].connect(str(setup.proxy.socket_path))
        sockets[4].settimeout(10)
        assert sockets[4].recv(100) == b""
    finally:
        for sock in sockets:
            sock.close()


def test_upstream_connection_limit(make_proxy: Any, web: _Server) -> None:
    setup = make_proxy(
        EgressPolicy.allowlist("allowed.test"),
        {"allowed.test": ("127.0.0.1", web.port)},
        limits=EgressLimits(max_upstream_connections=2),
    )
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", setup.port), timeout=10) as raw:
            raw.sendall(b"CONNECT allowed.test:80 HTTP/1.1\r\nHost: h\r\n\r\n")
            assert raw.recv(4096).startswith(b"HTTP/1.1 200 ")
            raw.sendall(b"GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
            assert b"hello from allowed" in raw.recv(4096) + raw.recv(4096)
    with socket.create_connection(("127.0.0.1", setup.port), timeout=10) as raw:
        raw.sendall(b"CONNECT allowed.test:80 HTTP/1.1\r\nHost: h\r\n\r\n")
        assert raw.recv(4096).startswith(b"HTTP/1.1 200 ")
        assert raw.recv(4096) == b""  # refused at connect: the tunnel closes
    assert "upstream connections are used up" in setup.refusals()[-1]["reason"]


def test_phase_change_switches_policy_and_cuts_tunnels(make_proxy: Any, web: _Server) -> None:
    setup = make_proxy(
        EgressPolicy.allowlist("agent.test"),
        {"agent.test": ("127.0.0.1", web.port), "verifier.test": ("127.0.0.1", web.port)},
    )
    assert setup.get("http://agent.test/").status_code == 200
    assert setup.get("http://verifier.test/").status_code == 403
    raw = socket.create_connection(("127.0.0.1", setup.port), timeout=10)
    raw.sendall(b"CONNECT agent.test:80 HTTP/1.1\r\nHost: h\r\n\r\n")
    assert raw.recv(4096).startswith(b"HTTP/1.1 200 ")
    setup.thread.set_phase("verifier", EgressPolicy.allowlist("verifier.test"))
    assert raw.recv(4096) == b""  # the agent's tunnel did not survive its phase
    raw.close()
    assert setup.get("http://agent.test/").status_code == 403
    assert setup.get("http://verifier.test/").status_code == 200
    setup.thread.set_phase("after", EgressPolicy(EgressMode.NO_NETWORK))
    answer = setup.get("http://verifier.test/")
    assert answer.status_code == 403 and "no network" in answer.text
    assert [(r["phase"], r["host"]) for r in setup.refusals()] == [
        ("agent", "verifier.test"),
        ("verifier", "agent.test"),
        ("after", "verifier.test"),
    ]


def test_a_replacement_upstream_gets_what_the_policy_admitted(make_proxy: Any) -> None:
    """The seam a cache plugs into: admitted requests and tunnels, nothing else."""
    seen: list[tuple[str, str, str]] = []

    class Canned:
        async def http(self, request: HttpRequest, context: EgressContext) -> HttpResponse:
            seen.append((context.phase, request.method, request.url))
            body = b"".join([chunk async for chunk in request.body])

            async def stream() -> Any:
                yield b"cached:" + body

            async def aclose() -> None:
                pass

            return HttpResponse(200, [(b"content-type", b"text/plain")], stream(), aclose)

        async def tunnel(
            self,
            host: str,
            port: int,
            client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
            context: EgressContext,
        ) -> None:
            seen.append((context.phase, "CONNECT", f"{host}:{port}"))
            client[1].write(b"tunnel to " + host.encode())
            await client[1].drain()

    overrides = {"pypi.cache.test": ("127.0.0.1", 9)}  # resolved, never connected to
    setup = make_proxy(EgressPolicy.allowlist("*.cache.test"), overrides, upstream=Canned())
    with httpx.Client(proxy=setup.url, trust_env=False, timeout=10) as client:
        answer = client.post("http://deb.cache.test:8080/a?b", content=b"up")
    assert answer.text == "cached:up"
    assert setup.get("http://other.test/").status_code == 403
    with socket.create_connection(("127.0.0.1", setup.port), timeout=10) as raw:
        raw.sendall(b"CONNECT pypi.cache.test:443 HTTP/1.1\r\nHost: h\r\n\r\n")
        data = b""
        while chunk := raw.recv(4096):
            data += chunk
    assert data.endswith(b"tunnel to pypi.cache.test")
    assert seen == [
        ("agent", "POST", "http://deb.cache.test:8080/a?b"),
        ("agent", "CONNECT", "pypi.cache.test:443"),
    ]


def _command_line(pid: int) -> list[bytes]:
    """The arguments of process ``pid``; none for a process that ended meanwhile."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return []


def test_the_forwarder_runs_from_its_source_alone(make_proxy: Any, web: _Server) -> None:
    """How the trial starts it in a container: ``python -I -c SOURCE --socket S --port N``
    (no harbor_exec importable), detached; it pipes a fixed port to the proxy."""
    import os
    import signal
    import subprocess
    import sys

    from harbor_exec.container import forward

    setup = make_proxy(
        EgressPolicy.allowlist("allowed.test"), {"allowed.test": ("127.0.0.1", web.port)}
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    source = Path(forward.__file__).read_text()
    socket_path = str(setup.proxy.socket_path)
    started = subprocess.run(
        [sys.executable, "-I", "-c", source, "--socket", socket_path, "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
    )
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == str(port)
    child = [
        int(pid)
        for pid in os.listdir("/proc")
        if pid.isdigit() and socket_path.encode() in _command_line(int(pid))
    ]
    assert len(child) == 1
    try:
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", trust_env=False, timeout=10) as c:
            assert c.get("http://allowed.test/x").text == "hello from allowed"
            assert c.get("http://other.test/x").status_code == 403
        # The port is taken while it runs: a second forwarder says so.
        again = subprocess.run(
            [sys.executable, "-I", "-c", source, "--socket", socket_path, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert again.returncode == 2 and f"127.0.0.1:{port}" in again.stderr
    finally:
        os.kill(child[0], signal.SIGKILL)


def test_a_forwarder_started_with_its_container_announces_itself(
    make_proxy: Any, web: _Server
) -> None:
    """``before_keep_alive``: it listens, announces its token and its pid, then becomes
    the keep-alive; the host knows it as the one process to spare (``Companion``) and
    nothing later that takes its place. (That it is not dumpable, in a container:
    ``test_egress_docker``.)"""
    import os
    import signal
    import subprocess
    import sys

    from harbor_exec.container import forward
    from harbor_exec.network.egress.container import forwarder_with_container

    setup = make_proxy(
        EgressPolicy.allowlist("allowed.test"), {"allowed.test": ("127.0.0.1", web.port)}
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    socket_path = str(setup.proxy.socket_path)
    announced = setup.proxy.expect_forwarder("tok-1")
    # A wrong token is refused and says nothing.
    assert not forward.announce(socket_path, "not-mine", 1)
    argv = forwarder_with_container("tok-1")
    argv[argv.index("--socket") + 1] = socket_path
    argv[argv.index("--port") + 1] = str(port)
    argv[0] = sys.executable
    keep_alive = subprocess.Popen([*argv, "/bin/sleep", "300"], cwd="/")
    try:
        assert announced.event.wait(30)
        companion = announced.companion
        assert companion is not None
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", trust_env=False, timeout=10) as c:
            assert c.get("http://allowed.test/x").text == "hello from allowed"
        # The announcing process became the keep-alive; its child serves.
        assert _command_line(keep_alive.pid)[0] == b"/bin/sleep"
        uid = os.getuid()
        assert companion.matches(companion.namespace_pid, keep_alive.pid, uid)
        assert not companion.matches(companion.namespace_pid, os.getpid(), uid)
        assert not companion.matches(companion.namespace_pid, keep_alive.pid, uid + 1)
        # Later announcements change nothing.
        assert forward.announce(socket_path, "tok-1", 1)
        assert announced.companion is companion
        # A forwarder started again for the port while this one serves: success.
        again = subprocess.run(
            [
                sys.executable,
                "-I",
                "-c",
                Path(forward.__file__).read_text(),
                "--socket",
                socket_path,
                "--port",
                str(port),
                "--in-use-ok",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert again.returncode == 0 and again.stdout.strip() == str(port)
        # A process started after the announcement is never the companion.
        late = Companion(companion.namespace_pid, companion.announced_at - 3600)
        assert not late.matches(companion.namespace_pid, keep_alive.pid, uid)
    finally:
        if announced.companion is not None:
            os.kill(announced.companion.namespace_pid, signal.SIGKILL)
        keep_alive.kill()
        keep_alive.wait(10)


def test_the_task_format_loads_no_http_library() -> None:
    """The task format checks allowlists with the egress policy; that must not load the
    proxy's HTTP libraries (``harbor_exec.network`` and its subpackages re-export
    nothing heavy)."""
    import subprocess
    import sys

    code = (
        "import sys, harbor_exec.tasks.discovery\n"
        "print(sorted(m for m in ('h11', 'httpcore', 'httpx') if m in sys.modules))"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[]"


def test_a_forwarder_racing_the_containers_own_for_the_port_stands_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where the host cannot spare the container's own forwarder, the container is
    restarted (its forwarder starts again with it) while the next phase starts one by
    exec: with ``SO_REUSEADDR`` both bind the port and the second learns it is taken
    only at ``listen``. With ``--in-use-ok`` that is success, not a failed phase (CI:
    the service image's rollout failed with ``EADDRINUSE`` from ``listen``)."""
    from harbor_exec.container import forward

    socket_path = tmp_path / "proxy.sock"
    socket_path.touch()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    own = socket.socket()
    own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    own.bind(("127.0.0.1", port))
    real_bind = socket.socket.bind

    def bind_then_the_other_listens(self: socket.socket, address: Any) -> None:
        real_bind(self, address)
        own.listen(1)  # the container's own forwarder gets there first

    monkeypatch.setattr(socket.socket, "bind", bind_then_the_other_listens)
    monkeypatch.setattr("os.fork", lambda: pytest.fail("it must not serve"))
    try:
        assert forward.run_forward(str(socket_path), port, in_use_ok=True) == forward.EXIT_OK
        assert capsys.readouterr().out.strip() == str(port)
    finally:
        own.close()
