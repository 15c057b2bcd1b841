"""Users as numeric ``uid:gid``, resolved from an image's own account files.

Docker resolves a user name at every exec from the container's ``/etc/passwd`` and
``/etc/group``, files the agent can rewrite (or wipe, making ``root`` unknown and the
verifier unrunnable). A trial therefore reads both files once, from a container that
was created but never started (nothing of the agent's has run), resolves every user
it needs here, and passes only ``uid:gid`` to later execs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harbor_exec.errors import HarborExecError

ROOT_ID = "0:0"
#: What a trial reads; each file is small, but an image's is still bounded.
ACCOUNT_FILES = ("/etc/passwd", "/etc/group")
MAX_ACCOUNT_FILE_BYTES = 4 * 2**20


class UnknownUserError(HarborExecError, ValueError):
    """A user (or group) name the image's account files do not define."""


@dataclass(frozen=True)
class ImageAccounts:
    """An image's ``/etc/passwd`` and ``/etc/group``, parsed: name -> id."""

    users: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (uid, gid)
    primary_gids: dict[int, int] = field(default_factory=dict)  # uid -> gid
    groups: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, passwd: bytes, group: bytes) -> ImageAccounts:
        users: dict[str, tuple[int, int]] = {}
        primary: dict[int, int] = {}
        for fields in _records(passwd, 4):
            uid, gid = _number(fields[2]), _number(fields[3])
            if uid is not None and gid is not None:
                users.setdefault(fields[0], (uid, gid))  # the first entry wins, as in libc
                primary.setdefault(uid, gid)
        groups: dict[str, int] = {}
        for fields in _records(group, 3):
            gid = _number(fields[2])
            if gid is not None:
                groups.setdefault(fields[0], gid)
        return cls(users, primary, groups)

    def resolve(self, user: str | int | None) -> str:
        """``user`` as Docker's ``--user`` takes it (``name``, ``uid``, ``name:group``,
        ``uid:gid``; None or "" is root) as ``uid:gid``, the way runc resolves it: a
        numeric uid the image does not list gets gid 0. Raises ``UnknownUserError``."""
        text = "" if user is None else str(user).strip()
        if text in ("", "root", "0"):
            return ROOT_ID
        name, _, group = text.partition(":")
        uid = _number(name)
        if uid is None:
            if name not in self.users:
                raise UnknownUserError(f"user {name!r} is not in the image's /etc/passwd")
            uid, gid = self.users[name]
        else:
            gid = self.primary_gids.get(uid, 0)
        if group:
            numeric = _number(group)
            if numeric is None and group not in self.groups:
                raise UnknownUserError(f"group {group!r} is not in the image's /etc/group")
            gid = numeric if numeric is not None else self.groups[group]
        return f"{uid}:{gid}"


def numeric_ids(user: str) -> tuple[int, int]:
    """``(uid, gid)`` of a resolved ``uid:gid``."""
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or 0)


def is_root(user: str) -> bool:
    """Whether a resolved ``uid:gid`` runs as root."""
    return numeric_ids(user)[0] == 0


def _records(data: bytes, min_fields: int) -> list[list[str]]:
    lines = data[:MAX_ACCOUNT_FILE_BYTES].decode("utf-8", errors="replace").splitlines()
    return [
        f
        for line in lines
        if not line.startswith("#") and len(f := line.split(":")) > min_fields - 1
    ]


def _number(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 10 else None
