"""The command server: a trial container's commands over one stream the host holds.

Started with the container, as root, before anything of the task runs: it is the
container's first process (``--then`` names the init it becomes after forking the
server), so no engine exec is needed to start it. The server connects to the host's
unix socket (``--socket``, a directory of the trial's mounted read-only), says hello
with its token and pid, then runs each command the host sends: argv, ``uid:gid``
(with the groups and ``HOME`` ``docker exec`` gives that user, read from the
container's own account files as runc reads them), working directory,
environment, stdin; its stdout and stderr go back in frames, then its exit code.

The host accepts one hello per container start, before the first command: a server
the agent starts later, or a connection of its own, is never heard
(``harbor_exec.sandbox.channel``). The server makes itself non-dumpable first, so no
process of the container (root included) can open its memory or ptrace it; the agent
can still kill it, and then the host runs the container's commands through the
engine again. Output a command writes is data inside the server's frames: nothing a
process in the container writes can make a frame of its own.

Frames, both ways: a 4-byte big-endian length (of what follows), a kind byte, a
4-byte request id, the payload. Standard library only: it runs on the read-only
runtime's Python, never the image's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any, Final

__all__ = [
    "ADDED_VARIABLES",
    "EXEC_START_FAILED",
    "FRAME_HEAD",
    "KIND_ERR",
    "KIND_EXIT",
    "KIND_HELLO",
    "KIND_OUT",
    "KIND_RUN",
    "KIND_STDIN",
    "MAX_FRAME",
    "encode_frame",
    "main",
    "read_exact",
    "read_frame",
]

#: length (of kind + id + payload), kind, request id.
FRAME_HEAD: Final = struct.Struct(">IBI")
#: The largest frame either side sends (a chunk of output or stdin, or a request).
MAX_FRAME: Final = 1 << 20
KIND_HELLO: Final = 0  # server -> host: {"token", "pid"}
KIND_OUT: Final = 1  # server -> host: stdout bytes
KIND_ERR: Final = 2  # server -> host: stderr bytes
KIND_EXIT: Final = 3  # server -> host: {"exit_code"}
KIND_RUN: Final = 10  # host -> server: {"argv", "user", "workdir", "env", "stdin"}
KIND_STDIN: Final = 11  # host -> server: stdin bytes; empty: end of input
#: What ``docker exec`` answers a command that could not start (on stdout, exit 126).
EXEC_START_FAILED: Final = 126
_CHUNK: Final = 64 * 1024
_OUTPUT_GRACE_SEC: Final = 2.0
#: Set in this process's environment by others than the container's config: runc
#: (``HOME``, the root user's) and Python (``LC_CTYPE``, its C locale coercion).
ADDED_VARIABLES: Final = ("HOME", "LC_CTYPE")


def encode_frame(kind: int, request: int, payload: bytes = b"") -> bytes:
    return FRAME_HEAD.pack(len(payload) + 5, kind, request) + payload


def read_exact(sock: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None at the end of the stream."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def read_frame(sock: socket.socket, max_payload: int = MAX_FRAME) -> tuple[int, int, bytes] | None:
    """The next frame's ``(kind, request, payload)``; None at the end of the stream or
    for a frame whose payload would pass ``max_payload`` (the stream is then over)."""
    head = read_exact(sock, FRAME_HEAD.size)
    if head is None:
        return None
    length, kind, request = FRAME_HEAD.unpack(head)
    if not 5 <= length <= max_payload + 5:
        return None
    payload = read_exact(sock, length - 5)
    return None if payload is None else (kind, request, payload)


class _Server:
    def __init__(self, sock: socket.socket, base_env: dict[str, str]) -> None:
        self.sock = sock
        self.base_env = base_env
        self.send_lock = threading.Lock()
        self.stdins: dict[int, queue.SimpleQueue[bytes]] = {}

    def send(self, kind: int, request: int, payload: bytes = b"") -> None:
        with self.send_lock:
            self.sock.sendall(encode_frame(kind, request, payload))

    def serve(self) -> None:
        while frame := read_frame(self.sock):
            kind, request, payload = frame
            if kind == KIND_RUN:
                # Started here, before the next frame is read: its stdin is in place
                # for the frames that follow.
                self.start(request, json.loads(payload))
            elif kind == KIND_STDIN:
                stdin = self.stdins.get(request)
                if stdin is not None:
                    stdin.put(payload)
                    if not payload:
                        self.stdins.pop(request, None)

    def start(self, request: int, spec: dict[str, Any]) -> None:
        try:
            process = self._start(request, spec)
        except Exception as exc:  # never a silent request: the host waits on its exit
            self._start_failed(request, f"the command server failed: {exc!r}")
            process = None
        if process is None:
            self.exited(request, EXEC_START_FAILED)
            return
        if process.stdin is not None:
            stdin: queue.SimpleQueue[bytes] = queue.SimpleQueue()
            self.stdins[request] = stdin
            threading.Thread(target=_feed, args=(process.stdin, stdin), daemon=True).start()
        threading.Thread(target=self.finish, args=(request, process), daemon=True).start()

    def exited(self, request: int, code: int) -> None:
        self.send(KIND_EXIT, request, json.dumps({"exit_code": code}).encode())

    def finish(self, request: int, process: subprocess.Popen[bytes]) -> None:
        readers = [
            threading.Thread(target=self._pump, args=(pipe, kind, request), daemon=True)
            for pipe, kind in ((process.stdout, KIND_OUT), (process.stderr, KIND_ERR))
        ]
        for reader in readers:
            reader.start()
        code = process.wait()
        # As ``docker exec``: a process the command left behind holding its output
        # delays the end by at most this grace, then the command has ended.
        deadline = time.monotonic() + _OUTPUT_GRACE_SEC
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        self.stdins.pop(request, None)
        self.exited(request, code if code >= 0 else 128 - code)

    def _start_failed(self, request: int, what: str) -> None:
        message = f"OCI runtime exec failed: exec failed: unable to start container process: {what}"
        self.send(KIND_OUT, request, (message + ": unknown\r\n").encode())

    def _start(self, request: int, spec: dict[str, Any]) -> subprocess.Popen[bytes] | None:
        argv = [str(a) for a in spec["argv"]]
        uid_text, colon, gid_text = str(spec.get("user") or "0:0").partition(":")
        uid = int(uid_text)
        name, home, primary = _passwd_entry(uid)
        # runc: "uid:gid" gets that group alone; "uid" the account's group and every
        # group that lists the account.
        gid = int(gid_text) if colon else primary
        groups = [gid] if colon else _groups_of(name, gid)
        env = dict(self.base_env)
        env.update({str(k): str(v) for k, v in (spec.get("env") or {}).items()})
        env.setdefault("HOME", home)
        workdir = spec.get("workdir") or None
        if workdir is not None and not os.path.isdir(workdir):
            self._start_failed(
                request,
                f'chdir to cwd ("{workdir}") set in config.json failed: no such file or directory',
            )
            return None
        try:
            return subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if spec.get("stdin") else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                user=uid,
                group=gid,
                extra_groups=groups,
                close_fds=True,
            )
        except FileNotFoundError:
            what = f'exec: "{argv[0]}": executable file not found in $PATH'
            if "/" in argv[0]:
                what = f'exec: "{argv[0]}": stat {argv[0]}: no such file or directory'
            self._start_failed(request, what)
            return None
        except PermissionError:
            self._start_failed(request, f'exec: "{argv[0]}": permission denied')
            return None

    def _pump(self, pipe: IO[bytes] | None, kind: int, request: int) -> None:
        assert pipe is not None
        with pipe:
            while chunk := os.read(pipe.fileno(), _CHUNK):
                self.send(kind, request, chunk)


def _feed(pipe: IO[bytes], chunks: queue.SimpleQueue[bytes]) -> None:
    """Write the host's stdin chunks to a command, in order; an empty one closes it. A
    command that stops reading loses the rest, as a pipe's writer sees it."""
    try:
        while chunk := chunks.get():
            pipe.write(chunk)
            pipe.flush()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


def _passwd_entry(uid: int) -> tuple[str | None, str, int]:
    """The user name, home and group of ``uid`` in the container's ``/etc/passwd``
    (runc's lookup for ``docker exec``): ``(None, "/", 0)`` when it has none."""
    try:
        with open("/etc/passwd", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.rstrip("\n").split(":")
                if len(fields) >= 6 and fields[2].strip().isdigit() and int(fields[2]) == uid:
                    gid = int(fields[3]) if fields[3].strip().isdigit() else 0
                    return fields[0], fields[5] or "/", gid
    except OSError:
        pass
    return None, "/", 0


def _groups_of(name: str | None, gid: int) -> list[int]:
    """The supplementary groups ``docker exec`` gives user ``name``: every group of the
    container's ``/etc/group`` that lists it, and its primary group."""
    groups = [gid]
    if name is None:
        return groups
    try:
        with open("/etc/group", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.rstrip("\n").split(":")
                if len(fields) >= 4 and fields[2].strip().isdigit():
                    members = fields[3].split(",")
                    if name in members and int(fields[2]) not in groups:
                        groups.append(int(fields[2]))
    except OSError:
        pass
    return groups


def _not_dumpable() -> None:
    """``PR_SET_DUMPABLE`` 0: no process of the container may open the server's
    memory or ptrace it (root without ``CAP_SYS_PTRACE`` included)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if int(libc.prctl(4, 0, 0, 0, 0)) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_DUMPABLE")


def serve(socket_path: str, token: str, keep: Sequence[str]) -> None:
    """Connect, say hello, serve until the host hangs up (then exit)."""
    _not_dumpable()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    hello = json.dumps({"token": token, "pid": os.getpid()}).encode()
    sock.sendall(encode_frame(KIND_HELLO, 0, hello))
    # What a command gets is the container's environment: not what runc gave this
    # process as its root user (HOME) nor what Python set for itself (LC_CTYPE, PEP 538).
    base = {k: v for k, v in os.environ.items() if k in keep or k not in ADDED_VARIABLES}
    _Server(sock, base).serve()


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    # Everything after --then is the init's argv, "--" and all: never argparse's to read.
    then: list[str] = []
    if "--then" in arguments:
        at = arguments.index("--then")
        arguments, then = arguments[:at], arguments[at + 1 :]
    parser = argparse.ArgumentParser(prog="commands", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the host's unix socket")
    parser.add_argument("--token", required=True, help="said in the hello")
    parser.add_argument(
        "--keep",
        action="append",
        default=[],
        choices=ADDED_VARIABLES,
        help="a variable the container's own environment sets (kept as it is)",
    )
    args = parser.parse_args(arguments)
    child = os.fork()
    if child == 0:
        # Whatever ends it, the host runs the container's commands through the engine.
        with contextlib.suppress(BaseException):
            serve(args.socket, args.token, args.keep)
        os._exit(0)
    if then:
        os.execv(then[0], then)
    return 0


if __name__ == "__main__":
    sys.exit(main())
