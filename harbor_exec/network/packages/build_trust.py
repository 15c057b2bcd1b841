"""Image builds that trust the package cache's CA, and keep nothing of it but public files.

A build through the cache (``harbor_exec.network.packages.build_gateway``) has its HTTPS
``CONNECT`` to port 443 terminated with the cache's CA like a trial's, so its steps
have to trust that CA while they run and the image must not trust it afterwards. The
legacy builder (the only one whose steps can join the gateway's namespace) has no
``RUN --mount``, so the build is sent:

* a context that is the task's own (``.dockerignore`` applied, as ever) plus a
  directory ``TRUST_CONTEXT_DIR`` holding only the public trust files
  (``trust.write_trust_dir``: the CA certificate bundle and ``apt.conf``; the key is
  never read for it);
* the task's Dockerfile rewritten by ``rewrite_dockerfile``: after every ``FROM`` (but
  ``FROM scratch``, which has no tool to fetch with) a ``COPY`` of that directory to
  ``TRUST_MOUNT`` and one ``ARG`` naming the trust variables (``trust.trust_env``);
* the trust variables' values as build arguments.

``ARG`` is not ``ENV``: the variables reach the stage's ``RUN`` steps and are not in the
image's config, so a container of the image trusts nothing of ours. What stays is the
``COPY``'s layer (the public bundle and ``apt.conf`` at ``TRUST_MOUNT``; a trial through
the cache mounts its own over it) and, as the legacy builder records every declared
argument a ``RUN`` sees, the variables' names and paths in the history of the ``RUN``
steps (``|8 APT_CONFIG=/run/harbor-exec-trust/apt.conf ...``): paths, no certificate.

``trust_conflict`` names what makes a Dockerfile build outside the cache instead
(an ``ENV`` of a trust variable, which would win over the build argument and make its
tool reject the cache's certificates).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from harbor_exec.network.packages.trust import APT_CONF, BUNDLE, TRUST_MOUNT, trust_env
from harbor_exec.sandbox.dockerfile_syntax import instructions

__all__ = [
    "TRUST_CONTEXT_DIR",
    "rewrite_dockerfile",
    "trust_conflict",
    "trust_context_files",
    "trust_lines",
]

#: The trust files' directory in a cached build's context.
TRUST_CONTEXT_DIR: Final = ".harbor-exec-trust"

_FROM = re.compile(r"^\s*from(\s|$)", re.IGNORECASE)
_ENV = re.compile(r"^\s*env\s", re.IGNORECASE)


def trust_lines() -> str:
    """What ``rewrite_dockerfile`` puts after a ``FROM``."""
    names = " ".join(sorted(trust_env()))
    return f"COPY {TRUST_CONTEXT_DIR}/ {TRUST_MOUNT}/\nARG {names}\n"


def trust_context_files(trust_dir: Path) -> dict[str, bytes]:
    """The public trust files of ``trust_dir`` as context entries (``TRUST_CONTEXT_DIR/...``):
    exactly the bundle and ``apt.conf``, nothing else that may be in the directory."""
    names = (BUNDLE, APT_CONF)
    return {f"{TRUST_CONTEXT_DIR}/{name}": (trust_dir / name).read_bytes() for name in names}


def _from_image(instruction: str) -> str:
    """The image a ``FROM`` instruction names (its flags skipped)."""
    for word in instruction.split()[1:]:
        if not word.startswith("--"):
            return word
    return ""


def rewrite_dockerfile(text: str) -> str:
    """``text`` with ``trust_lines()`` after every ``FROM`` instruction (its last line,
    continuations included) except ``FROM scratch``. Everything else is kept byte for
    byte: parser directives stay first, global ``ARG``s before the first ``FROM`` stay
    global, comments and line endings stay."""
    # Lines as the builder splits them: on "\n" only (not str.splitlines' other breaks).
    lines = text.split("\n")
    after: set[int] = set()
    for _start, end, instruction in instructions(lines):
        if _FROM.match(instruction) and _from_image(instruction).lower() != "scratch":
            after.add(end)
    out: list[str] = []
    for index, line in enumerate(lines):
        out.append(line)
        if index in after:
            out.extend(trust_lines().splitlines())
    rewritten = "\n".join(out)
    return rewritten if rewritten.endswith("\n") else rewritten + "\n"


def _env_names(instruction: str) -> list[str]:
    """The variable names an ``ENV`` instruction sets (``ENV a=1 b=2`` or ``ENV a 1``)."""
    rest = instruction.split(None, 1)[1] if len(instruction.split(None, 1)) > 1 else ""
    first = rest.split(None, 1)[0] if rest else ""
    if "=" not in first:
        return [first] if first else []
    return [word.split("=", 1)[0] for word in re.findall(r"(?:^|\s)([A-Za-z_][\w.-]*=)", rest)]


def trust_conflict(text: str, build_args: Mapping[str, str] | None = None) -> str | None:
    """Why the Dockerfile ``text`` (with the build's own ``build_args``) cannot trust the
    cache through build arguments, or None: an ``ENV`` that sets a trust variable (it
    wins over an ``ARG`` of that name) or a build argument of the build's own that does."""
    names = set(trust_env())
    for name in sorted(names & set(build_args or {})):
        return f"the build's own build argument {name}"
    for start, _end, instruction in instructions(text.split("\n")):
        if _ENV.match(instruction):
            for name in _env_names(instruction):
                if name in names:
                    return f"line {start + 1}: ENV {name}"
    return None
