"""The in-container forwarder: a loopback TCP port piped, byte for byte, to a unix socket.

How a container with no network (``network=none``) reaches a host service: the
model relay (``harbor_exec.network.relay``) and the allowlist egress proxy
(``harbor_exec.network.egress``) listen on unix sockets mounted into the
container; this forwarder listens on 127.0.0.1 inside it and copies bytes (no
parsing here). ``runner`` uses ``RelayForwarder`` and ``ForwarderThread``; the
trial runs this file itself as a program on the read-only runtime's interpreter
(its source on the command line, ``python -I -c SOURCE --socket PATH --port N``),
so it needs nothing in the container but that interpreter; there it pipes with
``selectors`` on one thread (``_pump_forever``), not asyncio. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __name__ != "__main__":
    # The program (the forwarder started in a container) pipes with ``selectors``
    # (``_pump_forever``): asyncio's import alone would cost each container ~45 ms of CPU.
    import asyncio
    import logging
    import threading

    logger = logging.getLogger("harbor_exec.container.forward")

__all__ = [
    "READY_PATH",
    "ForwarderThread",
    "RelayForwarder",
    "abort_connections",
    "announce",
    "main",
    "run_forward",
]

EXIT_OK = 0
EXIT_SETUP = 2

_PIPE_CHUNK = 64 * 1024
# How long a finished connection may take to deliver its last bytes to the workflow.
_CLOSE_GRACE_SEC = 2.0


async def abort_connections(
    writers: Iterable[asyncio.StreamWriter], handlers: Iterable[asyncio.Task[Any]]
) -> None:
    """Cut every connection (no flush) and wait for their handler tasks to end."""
    for writer in list(writers):
        writer.transport.abort()
    tasks = list(handlers)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


class RelayForwarder:
    """A loopback TCP port whose connections are piped, byte for byte, to a unix socket.

    The host's relay speaks HTTP on the socket; this end only copies bytes, so it
    adds no parsing and works in a container without any network.
    """

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, sock: socket.socket | None = None) -> int:
        """Listen on 127.0.0.1 (a free port; or on ``sock``, bound and listening
        already) and return the port."""
        if sock is not None:
            self._server = await asyncio.start_server(self._on_connection, sock=sock)
        else:
            self._server = await asyncio.start_server(self._on_connection, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def aclose(self) -> None:
        """Stop listening and cut every open connection."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        await abort_connections(self._writers, self._tasks)

    async def _on_connection(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._writers.add(client_writer)
        try:
            try:
                relay_reader, relay_writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError as exc:
                logger.warning("model relay %s is unreachable: %s", self.socket_path, exc)
                return
            self._writers.add(relay_writer)
            try:
                await asyncio.gather(
                    self._pipe(client_reader, relay_writer, client_writer),
                    self._pipe(relay_reader, client_writer, relay_writer),
                )
            finally:
                self._writers.discard(relay_writer)
                relay_writer.transport.abort()
        except asyncio.CancelledError:
            # Only aclose() cancels; ending normally keeps asyncio's stream callback
            # (3.12.0/3.12.1) from logging the cancellation as an error.
            pass
        finally:
            # Close, not abort: bytes still buffered for the client are delivered.
            client_writer.close()
            with contextlib.suppress(OSError, TimeoutError, asyncio.CancelledError):
                async with asyncio.timeout(_CLOSE_GRACE_SEC):
                    await client_writer.wait_closed()
            self._writers.discard(client_writer)
            client_writer.transport.abort()
            if task is not None:
                self._tasks.discard(task)

    @staticmethod
    async def _pipe(
        source: asyncio.StreamReader, sink: asyncio.StreamWriter, other: asyncio.StreamWriter
    ) -> None:
        try:
            while data := await source.read(_PIPE_CHUNK):
                sink.write(data)
                await sink.drain()
            # Pass the half-close on: an HTTP peer may still be answering.
            if sink.can_write_eof() and not sink.is_closing():
                sink.write_eof()
        except OSError:
            # One side broke: the other cannot finish its exchange either, but what
            # was already read is still delivered (close flushes, abort would not).
            sink.close()
            other.transport.abort()


class ForwarderThread:
    """A ``RelayForwarder`` on its own event loop in a daemon thread.

    Workflows may block their own loop (a synchronous HTTP client, ``requests``,
    the sync ``openai`` client); the forwarder must keep piping bytes meanwhile.
    """

    def __init__(self, socket_path: str) -> None:
        self.forwarder = RelayForwarder(socket_path)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="harbor-exec-relay", daemon=True
        )

    def start(self) -> int:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self.forwarder.start(), self._loop).result(10)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.forwarder.aclose(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


# --------------------------------------------------------------------------- the program's pump

#: Bytes read from one side ahead of what the other has taken, at most (per direction).
_PUMP_AHEAD = 4 * _PIPE_CHUNK
#: After the process runs out of descriptors, accepting waits this long (as asyncio does).
_ACCEPT_RETRY_SEC = 1.0
#: A connection to the host's socket that does not go through in this long is dropped.
_CONNECT_TIMEOUT_SEC = 5.0


class _End:
    """One socket of a piped pair and the bytes waiting to be written into it."""

    __slots__ = ("events", "out", "peer", "read_done", "sock", "write_shut")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.peer: _End = self
        self.out = bytearray()
        self.read_done = False  # its side said EOF, or broke: nothing more comes from it
        self.write_shut = False
        self.events = 0  # what the selector watches it for now


def _pump_forever(listener: socket.socket, socket_path: str) -> None:
    """The program's forwarder: one thread, ``selectors`` and plain sockets (the same
    bytes, half-closes and bounds as ``RelayForwarder``, without asyncio's import, which
    costs each container about 45 ms of CPU). Runs until the process is killed."""
    import selectors

    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ, None)
    accept_paused_until = 0.0

    def watch(end: _End) -> None:
        events = 0
        if not end.read_done and len(end.peer.out) < _PUMP_AHEAD:
            events |= selectors.EVENT_READ
        if end.out:
            events |= selectors.EVENT_WRITE
        if events == end.events:
            return
        if end.events == 0:
            selector.register(end.sock, events, end)
        elif events == 0:
            selector.unregister(end.sock)
        else:
            selector.modify(end.sock, events, end)
        end.events = events

    def close(end: _End) -> None:
        if end.events:
            selector.unregister(end.sock)
            end.events = 0
        end.sock.close()

    def shut_write(end: _End) -> None:
        if not end.write_shut:
            end.write_shut = True
            with contextlib.suppress(OSError):
                end.sock.shutdown(socket.SHUT_WR)  # pass the half-close on

    def settle(end: _End) -> None:
        """After an event on ``end``'s pair: pass EOFs on, end a finished pair."""
        for one in (end, end.peer):
            if one.peer.read_done and not one.out:
                shut_write(one)
        if end.read_done and end.peer.read_done and not end.out and not end.peer.out:
            close(end)
            close(end.peer)
            return
        if end.sock.fileno() < 0 or end.peer.sock.fileno() < 0:
            return
        watch(end)
        watch(end.peer)

    def broke(end: _End) -> None:
        """``end`` failed: it is gone; its peer gets what was read for it, then goes."""
        close(end)
        end.read_done, end.out = True, bytearray()
        peer = end.peer
        peer.read_done = True
        if not peer.out:
            close(peer)
        else:
            watch(peer)

    def accept() -> None:
        nonlocal accept_paused_until
        for _ in range(64):  # a few at a time: the open pairs get their turn
            try:
                client, _address = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    selector.unregister(listener)
                    accept_paused_until = time.monotonic() + _ACCEPT_RETRY_SEC
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.settimeout(_CONNECT_TIMEOUT_SEC)
                upstream.connect(socket_path)
            except OSError:
                upstream.close()
                client.close()
                continue
            client.setblocking(False)
            upstream.setblocking(False)
            near, far = _End(client), _End(upstream)
            near.peer, far.peer = far, near
            watch(near)
            watch(far)

    while True:
        timeout = None
        if accept_paused_until:
            timeout = max(0.0, accept_paused_until - time.monotonic())
        for key, mask in selector.select(timeout):
            end = key.data
            if end is None:
                accept()
                continue
            if end.sock.fileno() < 0:
                continue  # its pair ended earlier in this round
            try:
                if mask & selectors.EVENT_WRITE and end.out:
                    sent = end.sock.send(end.out)
                    del end.out[:sent]
                if mask & selectors.EVENT_READ and not end.read_done:
                    data = end.sock.recv(_PIPE_CHUNK)
                    if data:
                        end.peer.out += data
                    else:
                        end.read_done = True
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                broke(end)
                continue
            settle(end)
        if accept_paused_until and time.monotonic() >= accept_paused_until:
            accept_paused_until = 0.0
            selector.register(listener, selectors.EVENT_READ, None)


#: The request a forwarder started with its container sends once it listens: the
#: host's egress proxy answers it (``EgressProxy``) and so knows, without an exec,
#: that the container's proxy port accepts. The token is the container's own.
READY_PATH = "/.harbor-exec/forwarder-ready/"


def announce(socket_path: str, token: str, pid: int, timeout: float = 10.0) -> bool:
    """Tell the host service on ``socket_path`` that this forwarder (process ``pid``)
    listens."""
    request = (
        f"GET {READY_PATH}{token}/{pid} HTTP/1.1\r\nHost: forwarder\r\nConnection: close\r\n\r\n"
    )
    deadline = time.monotonic() + timeout
    while True:  # again while the host's proxy does not answer (a busy machine)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                conn.connect(socket_path)
                conn.sendall(request.encode("ascii"))
                return conn.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def run_forward(
    socket_path: str,
    port: int = 0,
    host: str = "127.0.0.1",
    *,
    ready: str | None = None,
    then: Sequence[str] = (),
    in_use_ok: bool = False,
) -> int:
    """``forward``: bind ``host`` (127.0.0.1 unless the container is a build gateway,
    ``harbor_exec.network.packages.build_gateway``) on ``port`` (or a free one) first, so
    the port printed accepts at once, then leave the exec behind: the child serves in a
    session of its own, stdio closed. Exit 2 when the socket is missing or the port is
    taken.

    Started with its container (``then``: the keep-alive, exec'd in this process's
    place once the child serves), it announces itself to the host with ``ready``
    (``announce``) instead of printing the port; the keep-alive runs whatever happened.
    ``in_use_ok``: a port already taken is that forwarder's (only where nothing else can
    hold it: right after every other process of the container was killed)."""
    if not os.path.exists(socket_path):
        print(f"the socket {socket_path} is missing", file=sys.stderr)
        return _then(then, EXIT_SETUP)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A fixed port is bound again after the last forwarder was killed: its closed
    # connections' TIME_WAIT must not keep it.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # With SO_REUSEADDR two forwarders starting at once may both bind: the
        # second learns the port is taken only here.
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if in_use_ok and exc.errno == errno.EADDRINUSE:
            # The container's own forwarder (started with it) already serves the port.
            print(port, flush=True)
            return EXIT_OK
        print(f"cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return _then(then, EXIT_SETUP)
    port = int(sock.getsockname()[1])
    sealed = ready is not None and _not_dumpable()
    child = os.fork()
    if child != 0:
        sock.close()
        if ready is not None:
            announce(socket_path, ready, child if sealed else 0)
        else:
            print(port, flush=True)
        return _then(then, EXIT_OK)
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        _pump_forever(sock, socket_path)
    finally:
        os._exit(0)


def _not_dumpable() -> bool:
    """``PR_SET_DUMPABLE`` 0 (inherited by the child): the host spares this forwarder
    across phases only then, so no process of the container's (root, or of our uid)
    may open its memory or ptrace it. False where it failed: the forwarder announces
    pid 0 and the host starts a new one for each later phase."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(4, 0, 0, 0, 0)) == 0  # PR_SET_DUMPABLE
    except (ImportError, OSError, AttributeError):
        return False


def _then(argv: Sequence[str], code: int) -> int:
    """Become ``argv`` (the container's keep-alive), else return ``code``."""
    if argv:
        os.execv(argv[0], list(argv))
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="forward", description="Pipe a loopback TCP port to a unix socket (detached)."
    )
    parser.add_argument("--socket", required=True, help="the host service's unix socket")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only)"
    )
    parser.add_argument("--ready", help="announce to the socket with this token when listening")
    parser.add_argument("--in-use-ok", action="store_true", help="a port in use is success")
    parser.add_argument(
        "--then", nargs=argparse.REMAINDER, default=[], help="exec this program after"
    )
    args = parser.parse_args(argv)
    return run_forward(
        args.socket,
        args.port,
        args.host,
        ready=args.ready,
        then=args.then,
        in_use_ok=args.in_use_ok,
    )


if __name__ == "__main__":
    sys.exit(main())
