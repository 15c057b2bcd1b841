"""Local upstreams with real bytes for ``bench_package_corpus.py``: one HTTPS and one
HTTP server on 127.0.0.1 that answer for the real hostnames (``deb.debian.org``,
``pypi.org``, ``files.pythonhosted.org``, ``astral.sh``), reached through the egress
overrides.

``record=True`` (bench preparation, host side): a request not yet stored is fetched
from the real registry (Debian mirror over HTTP; PyPI over verified HTTPS), stored
under ``store`` and answered; hosts that are not a package registry are never asked.
``record=False`` (the measurement): only stored answers, anything else is a 404, and
the servers can be made distant (``latency_sec`` before each answer, ``bytes_per_sec``
per connection), as ``tests/package_upstream.py``'s.

``astral.sh/uv/<version>/install.sh`` is a stand-in (astral.sh's installer fetches the
binary from GitHub releases, which is not a registry): a script that installs the same
uv version from its PyPI wheel (``files.pythonhosted.org``, so the wheel goes through
the cache as the release tarball would) into ``$HOME/.local/bin`` and writes
``$HOME/.local/bin/env``, as the real installer does.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path

#: Hosts whose content is fetched for real in recording mode (package registries).
REGISTRIES = {"deb.debian.org": "http", "pypi.org": "https", "files.pythonhosted.org": "https"}
#: Hosts answered by a stand-in.
STAND_INS = {"astral.sh"}
#: Response headers kept from the registry (what caches and clients look at).
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
KEPT = ("content-type", "etag", "last-modified", "cache-control", "expires", "location")

STAND_IN_INSTALLER = """#!/bin/sh
# Stand-in for astral.sh's uv {version} installer (harbor-exec bench): the same uv from
# its PyPI wheel instead of the GitHub release tarball.
set -eu
dest="${{XDG_BIN_HOME:-$HOME/.local/bin}}"
mkdir -p "$dest"
tmp="$(mktemp -d)"
curl -LsSf -o "$tmp/uv.whl" "{url}"
python3 - "$tmp/uv.whl" "$dest" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for name in wheel.namelist():
        base = os.path.basename(name)
        if "/scripts/" in name and base in ("uv", "uvx"):
            target = os.path.join(sys.argv[2], base)
            with open(target, "wb") as out:
                out.write(wheel.read(name))
            os.chmod(target, 0o755)
PY
rm -rf "$tmp"
cat > "$dest/env" <<'ENV'
#!/bin/sh
case ":${{PATH}}:" in
    *:"$HOME/.local/bin":*) ;;
    *) export PATH="$HOME/.local/bin:$PATH" ;;
esac
ENV
echo "installing to $dest"
echo "everything's installed!"
"""


@dataclass
class Stored:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class Corpus:
    """The stored answers, keyed by host, path and ``Accept`` (PyPI's pages vary on it)."""

    store: Path
    record: bool
    latency_sec: float = 0.0
    bytes_per_sec: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: (host, path, status, bytes sent, source, method, seconds) for every answer.
    seen: list[tuple[str, str, int, int, str, str, float]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def _key(self, host: str, path: str, accept: str) -> Path:
        digest = hashlib.sha256(f"{host}\n{path}\n{accept}".encode()).hexdigest()
        return self.store / host / digest[:2] / digest

    def load(self, host: str, path: str, accept: str) -> Stored | None:
        key = self._key(host, path, accept)
        try:
            meta = json.loads(key.with_suffix(".json").read_text())
            body = key.with_suffix(".body").read_bytes()
        except FileNotFoundError:
            return None
        return Stored(meta["status"], [tuple(h) for h in meta["headers"]], body)

    def save(self, host: str, path: str, accept: str, answer: Stored) -> None:
        key = self._key(host, path, accept)
        key.parent.mkdir(parents=True, exist_ok=True)
        key.with_suffix(".body").write_bytes(answer.body)
        meta: dict[str, object] = {"host": host, "path": path, "accept": accept}
        meta.update(status=answer.status, headers=answer.headers)
        key.with_suffix(".json").write_text(json.dumps(meta))

    def fetch(self, host: str, path: str, accept: str) -> Stored:
        """The registry's answer (recording mode), redirects not followed."""
        scheme = REGISTRIES[host]
        conn: http.client.HTTPConnection
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, 443, timeout=60, context=_public_tls())
        else:
            conn = http.client.HTTPConnection(host, 80, timeout=60)
        headers = {"Accept-Encoding": "identity", "User-Agent": "harbor-exec-bench/1"}
        if accept:
            headers["Accept"] = accept
        try:
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            body = response.read()
            kept = [(k, v) for k, v in response.getheaders() if k.lower() in KEPT]
            return Stored(response.status, kept, body)
        finally:
            conn.close()

    def stand_in(self, host: str, path: str) -> Stored | None:
        parts = path.split("?")[0].strip("/").split("/")
        if host != "astral.sh" or len(parts) != 3 or parts[0] != "uv" or parts[2] != "install.sh":
            return None
        version = parts[1]
        index = self.answer("pypi.org", "/simple/uv/", SIMPLE_JSON)
        if index is None or index.status != 200:
            return None
        wanted = f"uv-{version}-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
        files = json.loads(index.body)["files"]
        wheel = next((f["url"] for f in files if f["filename"] == wanted), None)
        if wheel is None:
            return None
        script = STAND_IN_INSTALLER.format(version=version, url=wheel).encode()
        etag = '"' + hashlib.sha256(script).hexdigest()[:16] + '"'
        headers = [("Content-Type", "text/x-sh"), ("ETag", etag)]
        return Stored(200, headers, script)

    def answer(self, host: str, path: str, accept: str) -> Stored | None:
        if host in STAND_INS:
            return self.stand_in(host, path)
        stored = self.load(host, path, accept)
        if stored is None and host == "deb.debian.org":
            # A Debian mirror answers the same whatever the Accept (apt sends one for
            # some indexes, the cache none): a client without the cache gets it too.
            for other in ("", "text/*"):
                stored = stored or self.load(host, path, other)
        if stored is None and self.record and host in REGISTRIES:
            stored = self.fetch(host, path, accept)
            self.save(host, path, accept, stored)
        return stored

    @staticmethod
    def with_validator(stored: Stored) -> Stored:
        """``stored`` with an ``ETag`` (the body's hash) when it has no validator: the
        real registries send one (PyPI's pages and files, the Debian mirror), but this
        host's egress proxy strips validators from what it relays."""
        names = {k.lower() for k, _ in stored.headers}
        if stored.status != 200 or names & {"etag", "last-modified"}:
            return stored
        etag = '"' + hashlib.sha256(stored.body).hexdigest()[:32] + '"'
        return Stored(stored.status, [*stored.headers, ("ETag", etag)], stored.body)

    def bytes_stored(self) -> int:
        return sum(p.stat().st_size for p in self.store.rglob("*.body"))


def _public_tls() -> ssl.SSLContext:
    """The host's trust (``SSL_CERT_FILE`` when set, as pip and curl use it)."""
    return ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE") or None)


def _validator_match(stored: Stored, headers: Message) -> bool:
    values = {k.lower(): v for k, v in stored.headers}
    tag = headers.get("If-None-Match")
    if tag and "etag" in values:
        return tag == values["etag"]
    since = headers.get("If-Modified-Since")
    return bool(since and values.get("last-modified") == since)


def _handler(corpus: Corpus) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _reply(self, head: bool) -> None:
            started = time.monotonic()
            host = (self.headers.get("Host") or "").split(":")[0].lower()
            accept = self.headers.get("Accept") or ""
            if accept in ("*/*",):
                accept = ""
            try:
                stored = corpus.answer(host, self.path, accept)
            except OSError as exc:
                stored = Stored(502, [], f"upstream: {exc}\n".encode())
            source = "stored"
            if stored is not None:
                stored = corpus.with_validator(stored)
            if stored is None:
                corpus.refused.append(f"{host}{self.path}")
                stored, source = Stored(404, [], b"not in the corpus\n"), "missing"
            status = stored.status
            if status == 200 and _validator_match(stored, self.headers):
                status = 304
            if corpus.latency_sec:
                time.sleep(corpus.latency_sec)
            self.send_response(status)
            for key, value in stored.headers:
                self.send_header(key, value)
            body = b"" if status == 304 else stored.body
            if status != 304:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            sent = 0
            if body and not head:
                rate = corpus.bytes_per_sec
                step = len(body) if not rate else max(1, int(rate / 20))
                for start in range(0, len(body), step):
                    self.wfile.write(body[start : start + step])
                    sent += min(step, len(body) - start)
                    if rate:
                        time.sleep(step / rate)
            with corpus.lock:
                corpus.seen.append(
                    (
                        host,
                        self.path,
                        status,
                        sent,
                        source,
                        self.command,
                        time.monotonic() - started,
                    )
                )

        def do_GET(self) -> None:
            self._reply(False)

        def do_HEAD(self) -> None:
            self._reply(True)

    return Handler


@contextmanager
def serve_corpus(corpus: Corpus, context: ssl.SSLContext) -> Iterator[tuple[int, int]]:
    """(HTTPS port, HTTP port) on 127.0.0.1 answering from ``corpus``."""
    servers = []
    threads = []
    for tls in (True, False):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(corpus))
        server.daemon_threads = True
        if tls:
            server.socket = context.wrap_socket(server.socket, server_side=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append(server)
        threads.append(thread)
    try:
        yield int(servers[0].server_address[1]), int(servers[1].server_address[1])
    finally:
        for server, thread in zip(servers, threads, strict=True):
            server.shutdown()
            server.server_close()
            thread.join(5)
