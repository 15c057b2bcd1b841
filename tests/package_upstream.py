"""A local upstream for the package cache's tests: an HTTP(S) file host on 127.0.0.1
that counts what it is asked, standing in for a mirror, a package index and a
release-file host."""

from __future__ import annotations

import email.utils
import hashlib
import http.server
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Resource:
    body: bytes
    status: int = 200
    etag: bool = True
    headers: dict[str, str] = field(default_factory=dict)
    #: This body's own rate (bytes a second; a drip-feeding server): the upstream's else.
    bytes_per_sec: float | None = None


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    status: int


class Upstream:
    """Routes (path with query -> Resource) and every request seen."""

    def __init__(self) -> None:
        self.routes: dict[str, Resource] = {}
        self.seen: list[Seen] = []
        self.lock = threading.Lock()
        self.port = 0
        # A distant mirror (benchmarks): seconds before each answer, bytes a second.
        self.latency_sec = 0.0
        self.bytes_per_sec: float | None = None

    def set(self, path: str, body: bytes, **kwargs: object) -> None:
        self.routes[path] = Resource(body, **kwargs)  # type: ignore[arg-type]

    def count(self, path: str, status: int | None = None, method: str | None = None) -> int:
        with self.lock:
            return sum(
                1
                for s in self.seen
                if s.path == path
                and (status is None or s.status == status)
                and (method is None or s.method == method)
            )

    def content_fetches(self) -> int:
        """Requests answered with a body (200s)."""
        with self.lock:
            return sum(1 for s in self.seen if s.status == 200 and s.method == "GET")


def _handler(upstream: Upstream) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def setup(self) -> None:
            # The handshake here, in the connection's own thread (not in accept, where
            # a client that never sends its hello would stop the server, shutdown too).
            if isinstance(self.request, ssl.SSLSocket):
                self.request.settimeout(30)
                self.request.do_handshake()
                self.request.settimeout(None)
            super().setup()

        def _answer(self, head: bool) -> None:
            resource = upstream.routes.get(self.path)
            headers = {k.lower(): v for k, v in self.headers.items()}
            if self.command not in ("GET", "HEAD"):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
            if resource is None:
                status, body, extra = 404, b"not found\n", {}
            else:
                status, body, extra = resource.status, resource.body, dict(resource.headers)
                if resource.etag:
                    tag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
                    extra["ETag"] = tag
                    if status == 200 and headers.get("if-none-match") == tag:
                        status = 304
            with upstream.lock:
                upstream.seen.append(Seen(self.command, self.path, headers, status))
            if upstream.latency_sec:
                time.sleep(upstream.latency_sec)
            self.send_response(status)
            for key, value in extra.items():
                self.send_header(key, value)
            if status != 304:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if status != 304 and not head:
                rate = (resource and resource.bytes_per_sec) or upstream.bytes_per_sec
                step = max(1, len(body) if not rate else int(rate / 20))
                for start in range(0, len(body), step):
                    self.wfile.write(body[start : start + step])
                    if rate:
                        time.sleep(step / rate)

        def do_GET(self) -> None:
            self._answer(False)

        def do_HEAD(self) -> None:
            self._answer(True)

        def do_POST(self) -> None:
            self._answer(False)

    return Handler


@contextmanager
def serve_upstream(context: ssl.SSLContext | None = None) -> Iterator[Upstream]:
    """An ``Upstream`` listening on 127.0.0.1 (TLS with ``context``) in a thread."""
    upstream = Upstream()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(upstream))
    server.daemon_threads = True
    if context is not None:
        server.socket = context.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    upstream.port = int(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield upstream
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


#: The test upstreams' HTTPS names, as an operator adds a private mirror to the
#: package hosts whose HTTPS the cache terminates (``PackageCacheConfig.tls_hosts``).
TEST_TLS_HOSTS = ("files.test", "pypi.test")


def sni_context(ca: Any) -> ssl.SSLContext:
    """A server context presenting ``ca``'s leaf for whatever name the client asks
    (``ca``: a ``LocalCA``, standing in for a public CA)."""
    context: ssl.SSLContext = ca.server_context("files.test")

    def pick(sock: ssl.SSLObject, name: str, _ctx: ssl.SSLContext) -> None:
        if name:
            sock.context = ca.server_context(name)

    context.sni_callback = pick
    return context


class AptSigner:
    """A throwaway GPG key (the host's ``gpg``) signing a Debian repo's ``Release``, as
    an archive's key does; ``keyring``: its public key, for apt's ``signed-by=``."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self._gpg("--quick-gen-key", "hx test repo <repo@hx.test>", "ed25519", "sign", "never")
        self.keyring: bytes = self._gpg("--export").stdout

    @classmethod
    @contextmanager
    def throwaway(cls) -> Iterator[AptSigner]:
        # Short: gpg-agent's socket lives in the home dir (a unix socket path has 107 bytes).
        home = Path(tempfile.mkdtemp(prefix="hx-gpg-"))
        home.chmod(0o700)
        try:
            yield cls(home)
        finally:
            subprocess.run(
                ["gpgconf", "--homedir", str(home), "--kill", "all"], capture_output=True
            )
            shutil.rmtree(home, ignore_errors=True)

    def _gpg(self, *args: str, data: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        command = ["gpg", "--homedir", str(self.home), "--batch", "--yes", "--pinentry-mode"]
        command += ["loopback", "--passphrase", "", *args]
        return subprocess.run(command, input=data, capture_output=True, check=True)

    def inrelease(self, release: bytes) -> bytes:
        return self._gpg("--clearsign", data=release).stdout

    def detached(self, release: bytes) -> bytes:
        return self._gpg("--armor", "--detach-sign", data=release).stdout


def deb_stanza(deb: Path | bytes, filename: str, control: str | None = None) -> bytes:
    """A ``Packages`` stanza for ``deb`` (a file, or its bytes with ``control``)."""
    data = deb if isinstance(deb, bytes) else deb.read_bytes()
    if control is None:
        assert isinstance(deb, Path)
        control = subprocess.run(
            ["dpkg-deb", "-f", str(deb)], capture_output=True, text=True, check=True
        ).stdout
    return (
        control.rstrip("\n")
        + f"\nFilename: {filename}\nSize: {len(data)}\nMD5sum: {hashlib.md5(data).hexdigest()}"
        f"\nSHA256: {hashlib.sha256(data).hexdigest()}\n\n"
    ).encode()


def release_file(suite: str, indexes: Sequence[tuple[str, bytes]]) -> bytes:
    """A ``Release`` listing ``indexes`` (path under ``dists/<suite>/``, body)."""
    md5 = "".join(f" {hashlib.md5(b).hexdigest()} {len(b)} {p}\n" for p, b in indexes)
    sha = "".join(f" {hashlib.sha256(b).hexdigest()} {len(b)} {p}\n" for p, b in indexes)
    return (
        f"Origin: hx-test\nLabel: hx-test\nSuite: {suite}\nCodename: {suite}\n"
        f"Date: {email.utils.formatdate(usegmt=True)}\nArchitectures: amd64\n"
        f"Components: main\nMD5Sum:\n{md5}SHA256:\n{sha}"
    ).encode()
