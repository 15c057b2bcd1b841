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

__all__ = ["base_images", "buildkit_only_syntax", "escape_char", "instructions"]

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


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_ARG = re.compile(r"^ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?", re.IGNORECASE)


def base_images(text: str, build_args: dict[str, str] | None = None) -> list[str]:
    """The images a build of this Dockerfile starts from or copies out of (``FROM``,
    ``COPY --from``, ``RUN --mount=from=``), earlier stages and ``scratch`` left out,
    with the ``ARG`` defaults before the first ``FROM`` (and ``build_args`` over them)
    substituted. ``ValueError`` for a reference that still names a variable."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    found: list[str] = []
    seen_from = False

    def resolve(value: str) -> str:
        def one(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(3)
            if name in args:
                return args[name]
            if match.group(2) is not None:
                return match.group(2)
            raise ValueError(f"the image {value!r} names ${name}, which has no value")

        return _VARIABLE.sub(one, value)

    def add(reference: str) -> None:
        image = resolve(reference.strip("\"'"))
        if image.lower() == "scratch" or image.lower() in stages or image.isdigit():
            return
        if image not in found:
            found.append(image)

    for _start, _end, joined in instructions(text.split("\n")):
        words = joined.split()
        keyword = words[0].upper() if words else ""
        if keyword == "ARG" and not seen_from and (arg := _ARG.match(joined)):
            args[arg.group(1)] = (build_args or {}).get(arg.group(1), arg.group(2) or "")
            if arg.group(2) is None and arg.group(1) not in (build_args or {}):
                del args[arg.group(1)]
        elif keyword == "FROM":
            seen_from = True
            rest = [w for w in words[1:] if not w.startswith("--")]
            if rest:
                add(rest[0])
            if len(rest) >= 3 and rest[1].upper() == "AS":
                stages.add(rest[2].lower())
        elif keyword in ("COPY", "ADD", "RUN"):
            for word in words[1:]:
                if word.startswith("--from="):
                    add(word.removeprefix("--from="))
                elif word.startswith("--mount=") and "from=" in word:
                    for part in word.removeprefix("--mount=").split(","):
                        if part.startswith("from="):
                            add(part.removeprefix("from="))
    return found
