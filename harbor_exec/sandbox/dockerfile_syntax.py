"""Which Dockerfiles need BuildKit: syntax the legacy builder does not parse.

Builds through the package cache run on the legacy builder, the only one whose RUN
steps can join another container's network namespace (``ImageBuild.network``); a
Dockerfile written for BuildKit (a ``# syntax=`` frontend, ``RUN --mount``, heredocs,
``COPY --link``, ...) is built by BuildKit instead, outside the cache, rather than
failing. The check is by instruction and flag, on logical lines (continuations
joined, comments dropped), not a full parser: what it names is certain, what it misses
fails the build with the legacy builder's own message.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["buildkit_only_syntax", "escape_char", "instructions"]

_DIRECTIVE = re.compile(r"^#\s*(\w+)\s*=\s*(\S+)\s*$")
#: Flags only BuildKit's Dockerfile frontend knows, per instruction.
_BUILDKIT_FLAGS: Final = {
    "RUN": ("--mount", "--network", "--security"),
    "COPY": ("--link", "--parents", "--exclude", "--chmod"),
    "ADD": ("--link", "--exclude", "--chmod", "--checksum", "--keep-git-dir"),
}
# ``<<EOF``, ``<<-EOF``, ``<<"EOF"`` but not the shell's here-string ``<<<``.
_HEREDOC = re.compile(r"(?<!<)<<-?\s*[\"']?[A-Za-z_][A-Za-z0-9_]*[\"']?")


def escape_char(lines: list[str]) -> str:
    """The escape character: ``# escape=`` among the parser directives, else ``\\``."""
    for raw in lines:  # parser directives come first, before any other line
        found = _DIRECTIVE.match(raw.strip())
        if found is None:
            break
        if found.group(1).lower() == "escape":
            return found.group(2)
    return "\\"


def instructions(lines: list[str]) -> list[tuple[int, int, str]]:
    """``(first line index, last line index, joined text)`` of every instruction of a
    Dockerfile split into ``lines``: continuations joined, comment and blank lines
    inside one skipped (the builder does the same), comment lines between
    instructions (parser directives too) dropped."""
    escape = escape_char(lines)
    found: list[tuple[int, int, str]] = []
    parts: list[str] = []
    start = 0
    for index, raw in enumerate(lines):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # between instructions, or inside a continued one
        if not parts:
            start = index
        if stripped.endswith(escape):
            parts.append(stripped[: -len(escape)])
            continue
        parts.append(stripped)
        found.append((start, index, " ".join(parts)))
        parts = []
    if parts:
        found.append((start, len(lines) - 1, " ".join(parts)))
    return found


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """``(first line number, instruction text)`` with continuations joined."""
    return [(start + 1, joined) for start, _end, joined in instructions(text.split("\n"))]


def buildkit_only_syntax(text: str) -> str | None:
    """What in the Dockerfile ``text`` the legacy builder cannot build (``"line 3: RUN
    --mount"``), or None."""
    for raw in text.splitlines():
        found = _DIRECTIVE.match(raw.strip())
        if found is None:
            break
        if found.group(1).lower() == "syntax":
            return f"the '# syntax={found.group(2)}' frontend directive"
    for number, line in _logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        flags = _BUILDKIT_FLAGS.get(keyword, ())
        for word in rest.split():
            if not word.startswith("--"):
                break  # flags come before the arguments
            name = word.split("=", 1)[0]
            if name in flags:
                return f"line {number}: {keyword} {name}"
        if keyword in _BUILDKIT_FLAGS and _HEREDOC.search(rest):
            return f"line {number}: a heredoc in {keyword}"
    return None
