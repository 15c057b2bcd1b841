"""The forwarder as the containers run it: ``forward.py`` as a program on a bare
interpreter (``python -I -S -c SOURCE``), piping a loopback port to a unix socket with
its ``selectors`` pump. Byte-exact both ways, half-closes passed on, a slow reader never
makes it read ahead without bound, a broken side ends the pair, and a process out of
descriptors goes on accepting once some are free. (Through the real egress proxy and a
container: tests/test_egress.py, tests/test_native_*_docker.py.)"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harbor_exec.container import forward
from tests.server_utils import wait_until

MiB = 1024 * 1024


class Upstream:
    """A unix-socket service; each connection's first line picks what it does."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sent: dict[str, int] = {}
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(256)
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            line = b""
            while not line.endswith(b"\n"):
                chunk = conn.recv(1)
                if not chunk:
                    return
                line += chunk
            verb, _, arg = line.decode().strip().partition(" ")
            if verb == "echo":  # everything back, then EOF after the client's
                while data := conn.recv(65536):
                    conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
            elif verb == "digest":  # read to the client's EOF, then answer
                digest = hashlib.sha256()
                while data := conn.recv(65536):
                    digest.update(data)
                conn.sendall(digest.hexdigest().encode())
            elif verb == "send":  # arg bytes, counted as they go
                name, size = arg.split()
                self.sent[name] = 0
                block = bytes(range(256)) * 256
                while self.sent[name] < int(size):
                    conn.sendall(block)
                    self.sent[name] += len(block)
            elif verb == "reset":  # gone at once, with a reset
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[Upstream]:
    service = Upstream(tmp_path / "up.sock")
    yield service
    service.close()


def start_forwarder(socket_path: Path, *, nofile: int | None = None) -> tuple[int, int]:
    """The program as a container starts it: (its port, the serving child's pid)."""

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    source = Path(forward.__file__).read_text(encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", source, "--socket", str(socket_path)],
        capture_output=True, text=True, timeout=30, check=True, preexec_fn=limit,
    )  # fmt: skip
    port = int(done.stdout.strip())
    # The child that serves: in a session of its own, named by the socket on its argv.
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if entry.name.isdigit() and str(socket_path).encode() in argv:
                return port, int(entry.name)
    raise AssertionError("the forwarder's serving process is not found")


@pytest.fixture
def forwarder(upstream: Upstream) -> Iterator[int]:
    port, pid = start_forwarder(upstream.path)
    yield port
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)


def connect(port: int, first_line: str) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn.sendall(first_line.encode() + b"\n")
    return conn


def read_all(conn: socket.socket) -> bytes:
    out = bytearray()
    while data := conn.recv(1 << 20):
        out += data
    return bytes(out)


def test_bytes_go_both_ways_exactly_and_eof_is_passed_on(forwarder: int) -> None:
    payload = os.urandom(24 * MiB)
    with connect(forwarder, "echo") as conn:

        def send() -> None:
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        echoed = read_all(conn)  # ends: the service's EOF came through
        sender.join()
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()
    # A half-close: the service reads to the client's EOF, then still answers.
    with connect(forwarder, "digest") as conn:
        conn.sendall(payload[: 3 * MiB])
        conn.shutdown(socket.SHUT_WR)
        assert read_all(conn).decode() == hashlib.sha256(payload[: 3 * MiB]).hexdigest()


def test_many_connections_at_once(forwarder: int) -> None:
    blobs = [os.urandom(64 * 1024 + n) for n in range(100)]
    conns = [connect(forwarder, "digest") for _ in blobs]
    try:
        for conn, blob in zip(conns, blobs, strict=True):
            conn.sendall(blob)
            conn.shutdown(socket.SHUT_WR)
        answers = [read_all(conn).decode() for conn in conns]
    finally:
        for conn in conns:
            conn.close()
    assert answers == [hashlib.sha256(blob).hexdigest() for blob in blobs]


def test_a_reader_that_stops_holds_the_sender_back(upstream: Upstream, forwarder: int) -> None:
    """The service sends 256 MiB to a client that reads nothing: the forwarder takes at
    most a bounded amount ahead (what the kernel buffers plus its own 256 KiB), then all
    of it once the client reads."""
    total = 256 * MiB
    with connect(forwarder, f"send flood {total}") as conn:
        assert wait_until(lambda: upstream.sent.get("flood", 0) > 0)
        seen: list[int] = []

        def stalled() -> bool:
            seen.append(upstream.sent["flood"])
            return len(seen) > 5 and seen[-1] == seen[-6]

        assert wait_until(stalled, timeout=20, interval=0.05)
        assert upstream.sent["flood"] < 32 * MiB, upstream.sent
        received = 0
        while received < total:
            received += len(conn.recv(1 << 20))
    assert received == total


def test_a_side_that_breaks_ends_the_pair(upstream: Upstream) -> None:
    port, pid = start_forwarder(upstream.path)
    try:
        with connect(port, "reset") as conn, contextlib.suppress(ConnectionResetError):
            assert read_all(conn) == b""
        # The forwarder serves on.
        with connect(port, "digest") as conn:
            conn.shutdown(socket.SHUT_WR)
            assert read_all(conn).decode() == hashlib.sha256(b"").hexdigest()
    finally:
        os.kill(pid, 9)


def test_a_service_that_is_not_there_closes_the_connection(
    tmp_path: Path, upstream: Upstream
) -> None:
    port, pid = start_forwarder(upstream.path)
    try:
        upstream.close()
        os.unlink(upstream.path)
        with connect(port, "echo") as conn, contextlib.suppress(ConnectionResetError):
            assert read_all(conn) == b""
    finally:
        os.kill(pid, 9)


def test_out_of_descriptors_it_accepts_again_once_some_are_free(upstream: Upstream) -> None:
    port, pid = start_forwarder(upstream.path, nofile=24)
    held: list[socket.socket] = []
    try:
        # Two descriptors a pair: some of these are never piped (closed or left waiting).
        for _ in range(20):
            held.append(connect(port, "echo"))
        for conn in held:
            conn.close()
        held.clear()

        def one_round_trip() -> bool:
            with connect(port, "digest") as conn:
                conn.settimeout(5)
                conn.shutdown(socket.SHUT_WR)
                with contextlib.suppress(OSError):
                    return read_all(conn).decode() == hashlib.sha256(b"").hexdigest()
            return False

        done: Callable[[], bool] = one_round_trip
        assert wait_until(done, timeout=10, interval=0.2)
        # It waited for descriptors, never spun: its CPU stayed small.
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[12])
        assert ticks / os.sysconf("SC_CLK_TCK") < 2.0
    finally:
        for conn in held:
            conn.close()
        os.kill(pid, 9)
