"""Kill a container's processes from the host, through its cgroup.

A hostile agent can detach from anything we start (``setsid``, double forks) and
can fill its pids limit so that no kill command can fork inside the container.
From the host none of that matters: freeze the container's cgroup (nothing in it
runs or forks any more), SIGKILL every process in it but the init and init's own
child (``sleep infinity``), thaw, and confirm that only those two remain.

This needs the host's view of the container (its PID namespace and a writable
cgroup filesystem: ``harbor-exec`` running on the Docker host as root). Where
that view is missing, ``HostCgroup.of`` returns None and the runtime falls back
to restarting the container through the engine. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CGROUP_ROOT = Path("/sys/fs/cgroup")
_SETTLE_SEC = 2.0


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` fields after the command name (field 3 onwards)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


@dataclass(frozen=True)
class Companion:
    """A process of ours beside the keep-alive, spared by the kill between phases: the
    egress forwarder (the keep-alive's child, the runtime's uid) or the command server
    (the init's child, root), as it announced itself before any task process ran: its
    pid in the container's namespace and when (``CLOCK_BOOTTIME`` seconds). A process is
    it only while it has that pid, has that parent, runs as that uid (None: the kill's
    owner uid) and started before the announcement: a process the agent made later
    (after killing ours) is none of that, whatever pid it gets."""

    namespace_pid: int
    announced_at: float
    uid: int | None = None
    parent: Literal["keep-alive", "init"] = "keep-alive"

    def matches(self, pid: int, parent_pid: int, owner_uid: int) -> bool:
        fields = _stat_fields(pid)
        uid = owner_uid if self.uid is None else self.uid
        if fields is None or int(fields[1]) != parent_pid or _real_uid(pid) != uid:
            return False
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return started <= self.announced_at and _namespace_pid(pid) == self.namespace_pid


@dataclass(frozen=True)
class HostCgroup:
    """The freezer of one container's cgroup, as the host sees it."""

    directory: Path
    version: int  # 1: the v1 freezer controller; 2: the unified hierarchy

    @classmethod
    def of(cls, init_pid: int, container_id: str) -> HostCgroup | None:
        """The cgroup of ``init_pid`` when it is ``container_id``'s and we can freeze it."""
        try:
            lines = Path(f"/proc/{init_pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _id, controllers, path = line.split(":", 2)
            # The container id in the path guards against a PID seen from another namespace.
            if container_id not in path:
                continue
            if "freezer" in controllers.split(","):
                found = cls(CGROUP_ROOT / "freezer" / path.lstrip("/"), 1)
            elif controllers == "" and _id == "0":
                found = cls(CGROUP_ROOT / path.lstrip("/"), 2)
            else:
                continue
            if os.access(found._freeze_file, os.W_OK):
                return found
        return None

    @property
    def _freeze_file(self) -> Path:
        return self.directory / ("freezer.state" if self.version == 1 else "cgroup.freeze")

    def pids(self) -> set[int]:
        text = (self.directory / "cgroup.procs").read_text()
        return {int(line) for line in text.split()}

    def _set_frozen(self, frozen: bool) -> None:
        if self.version == 1:
            self._freeze_file.write_text("FROZEN" if frozen else "THAWED")
        else:
            self._freeze_file.write_text("1" if frozen else "0")

    def _is_frozen(self) -> bool:
        if self.version == 1:
            return self._freeze_file.read_text().strip() == "FROZEN"
        return "frozen 1" in (self.directory / "cgroup.events").read_text()

    def kill_all_but_init(
        self,
        init_pid: int,
        owner_uid: int | None = None,
        companions: Sequence[Companion] = (),
    ) -> list[Companion] | None:
        """SIGKILL every process but ``init_pid`` and its first child; once confirmed,
        the companions spared (empty: none), else None.

        With ``owner_uid`` the first child is spared only while it runs as that uid
        (the runtime's keep-alive does; nothing the agent started can). ``companions``:
        more processes to spare, each only while it is exactly the one that announced
        itself (``Companion.matches``)."""
        spared: dict[int, Companion] = {}
        deadline = time.monotonic() + _SETTLE_SEC
        self._set_frozen(True)
        try:
            while not self._is_frozen():
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.001)
            pids = self.pids()
            if owner_uid is not None:
                # The command server is the init's child too, started before the
                # keep-alive: it is not the container's own command.
                spared = _matching(companions, "init", init_pid, pids, owner_uid)
            keep = {init_pid} | _first_child(init_pid, pids - set(spared), owner_uid)
            if owner_uid is not None and len(keep) == 2:
                (first,) = keep - {init_pid}
                spared |= _matching(companions, "keep-alive", first, pids, owner_uid)
            keep |= set(spared)
            for pid in self.pids() - keep:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            self._set_frozen(False)
        while not self.pids() <= keep:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.002)
        for pid in spared:  # one the agent stopped (SIGSTOP) runs again
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        return list(spared.values())


def _matching(
    companions: Sequence[Companion], parent: str, parent_pid: int, pids: set[int], owner_uid: int
) -> dict[int, Companion]:
    """The host pids of ``companions`` under ``parent`` that are exactly themselves."""
    found: dict[int, Companion] = {}
    for companion in companions:
        if companion.parent != parent:
            continue
        for pid in pids:
            if companion.matches(pid, parent_pid, owner_uid):
                found[pid] = companion
    return found


def _first_child(init_pid: int, pids: set[int], owner_uid: int | None = None) -> set[int]:
    """The child of the init that started first (of those running as ``owner_uid``,
    when given): the container's own command.

    Everything else init is parent of was reparented to it after its parent died
    (a detached agent process), so it started later. The command server (root) starts
    before the keep-alive: killed by the agent, it may not have exited yet when the
    host looks (a busy machine), and must not be taken for the container's command.
    """
    children: list[tuple[int, int]] = []
    for pid in pids:
        fields = _stat_fields(pid)
        # Not a dead child the init has yet to reap: it is no longer anything to keep.
        if fields is None or int(fields[1]) != init_pid or fields[0] in ("Z", "X"):
            continue
        if owner_uid is None or _real_uid(pid) == owner_uid:
            children.append((int(fields[19]), pid))  # (starttime, pid)
    return {min(children)[1]} if children else set()


def parent_pid(pid: int) -> int | None:
    """``pid``'s parent, as this host sees both (None: no such process)."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def _status_field(pid: int, key: str) -> list[str] | None:
    """The values of ``key`` in ``/proc/<pid>/status`` (None: no such process or line)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith(f"{key}:"):
            return line.split()[1:]
    return None


def _namespace_pid(pid: int) -> int | None:
    """``pid``'s number in its own (innermost) PID namespace."""
    values = _status_field(pid, "NSpid")
    return int(values[-1]) if values else None


def _real_uid(pid: int) -> int | None:
    values = _status_field(pid, "Uid")
    return int(values[0]) if values else None


__all__ = ["Companion", "HostCgroup", "parent_pid"]
