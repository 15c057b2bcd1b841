"""The seccomp profile of every trial container: Docker's default, minus tracing.

Docker's default profile allows ``ptrace`` on kernels >= 4.8, and with it an agent can
take over any process it may signal (the keep-alive, a verifier process started as
the same user) and rewrite the reward after ``test.sh``. The profile trial containers
get is derived at run time from the engine's own default (never copied into this
repository): every allow rule loses ``DENIED_SYSCALLS``, so they fall to the profile's
default action (EPERM); everything else stays as Docker wrote it. A task can ask for
some of them back through an image label (``SECCOMP_ALLOW_LABEL``), the way it asks
for capabilities.

The source is Debian's ``golang-github-docker-docker-dev`` copy of the profile
(``DOCKER_DEFAULT_PROFILE``), or the file an operator names (``SECCOMP_PROFILE_ENV``).
Without a source, containers are not created: there is no silent fallback to a
profile that allows ``ptrace``. Standard library only.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from harbor_exec.errors import EnvironmentStartError

#: Syscalls no trial container gets unless its task asks for them back: each lets one
#: process read, write or steer another's memory.
DENIED_SYSCALLS = ("ptrace", "process_vm_readv", "process_vm_writev")
#: An image label naming syscalls (of ``DENIED_SYSCALLS``) the task needs back, e.g.
#: ``LABEL harbor-exec.seccomp-allow="ptrace"`` for a task that runs a debugger.
SECCOMP_ALLOW_LABEL = "harbor-exec.seccomp-allow"
#: Where Debian's ``golang-github-docker-docker-dev`` puts Docker's default profile.
DOCKER_DEFAULT_PROFILE = Path(
    "/usr/share/gocode/src/github.com/docker/docker/profiles/seccomp/default.json"
)
PROFILE_PACKAGE = "golang-github-docker-docker-dev"
#: The operator's choice of another source profile (a JSON file in Docker's format).
SECCOMP_PROFILE_ENV = "HARBOR_EXEC_SECCOMP_PROFILE"


class SeccompProfileError(EnvironmentStartError):
    """The source seccomp profile is missing or unreadable: no container is created."""


def derive_profile(source: dict[str, Any], denied: Iterable[str]) -> dict[str, Any]:
    """``source`` with every name in ``denied`` removed from every allow rule.

    Rules left with no names are dropped (Docker refuses a rule without one); deny
    rules, the default action, architectures and conditions stay as they were.
    """
    denied_set = set(denied)
    derived = copy.deepcopy(source)
    rules: list[dict[str, Any]] = []
    for rule in derived.get("syscalls") or []:
        if rule.get("action") == "SCMP_ACT_ALLOW":
            names = [n for n in rule.get("names") or [] if n not in denied_set]
            if rule.get("name") in denied_set:  # the old single-name form
                del rule["name"]
            if not names and "name" not in rule:
                continue
            if "names" in rule or names:
                rule["names"] = names
        rules.append(rule)
    derived["syscalls"] = rules
    return derived


def requested_syscalls(label: str | None) -> tuple[str, ...]:
    """The ``DENIED_SYSCALLS`` a ``SECCOMP_ALLOW_LABEL`` value asks back (others ignored)."""
    wanted = {name.strip().lower() for name in (label or "").split(",")}
    return tuple(name for name in DENIED_SYSCALLS if name in wanted)


class SeccompProfiles:
    """Derived profiles as the JSON text Docker takes (``seccomp=<json>``), cached per
    source digest and set of syscalls given back."""

    def __init__(self, source: Path | str | None = None) -> None:
        configured = source or os.environ.get(SECCOMP_PROFILE_ENV) or None
        self.operator_chose = configured is not None
        self.source = Path(configured) if configured else DOCKER_DEFAULT_PROFILE
        self._cache: dict[tuple[str, tuple[str, ...]], str] = {}
        self._lock = threading.Lock()

    def _read_source(self) -> bytes:
        try:
            return self.source.read_bytes()
        except OSError as exc:
            if self.operator_chose:
                where = f"the profile named by ${SECCOMP_PROFILE_ENV} ({self.source})"
            else:
                where = (
                    f"Docker's default seccomp profile ({self.source}; install Debian's "
                    f"{PROFILE_PACKAGE}, e.g. with scripts/setup.sh)"
                )
            raise SeccompProfileError(
                f"cannot read {where}: {exc.strerror or exc}; trial containers never run "
                f"without their seccomp profile (set ${SECCOMP_PROFILE_ENV} to a profile file "
                "in Docker's JSON format to use another one)"
            ) from None

    def security_opt(self, allowed: Iterable[str] = ()) -> str:
        """``seccomp=<json>`` denying ``DENIED_SYSCALLS`` but ``allowed``."""
        raw = self._read_source()  # read every time: a replaced file takes effect
        given_back = tuple(sorted(set(allowed) & set(DENIED_SYSCALLS)))
        key = (hashlib.sha256(raw).hexdigest(), given_back)
        with self._lock:
            cached = self._cache.get(key)
        if cached is None:
            try:
                source = json.loads(raw)
                if not isinstance(source, dict) or "defaultAction" not in source:
                    raise ValueError("no defaultAction")
            except ValueError as exc:
                raise SeccompProfileError(
                    f"the seccomp profile {self.source} is not a Docker profile ({exc}); "
                    f"point ${SECCOMP_PROFILE_ENV} at a valid one"
                ) from None
            denied = [n for n in DENIED_SYSCALLS if n not in given_back]
            cached = json.dumps(derive_profile(source, denied), separators=(",", ":"))
            with self._lock:
                self._cache[key] = cached
        return f"seccomp={cached}"


__all__ = [
    "DENIED_SYSCALLS",
    "DOCKER_DEFAULT_PROFILE",
    "PROFILE_PACKAGE",
    "SECCOMP_ALLOW_LABEL",
    "SECCOMP_PROFILE_ENV",
    "SeccompProfileError",
    "SeccompProfiles",
    "derive_profile",
    "requested_syscalls",
]
