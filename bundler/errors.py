"""Every error the bundler raises, in one place.

Each class says in its docstring when it happens; each message names the file or
ref at fault and what to do about it, so that ``harbor-exec bundle`` can print it
as is and a backend can put it in a rollout's ``err_message`` before any container
starts.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "BundleBuildError",
    "BundleError",
    "DependencyDownloadError",
    "EntryPointError",
    "ProjectLayoutError",
    "output_tail",
]

# Enough of a build log to show the real error, short enough for a terminal.
_TAIL_LINES = 40
_TAIL_CHARS = 6000


def output_tail(output: str, lines: int = _TAIL_LINES) -> str:
    """The last ``lines`` lines of a tool's output, trimmed to a readable size."""
    tail = "\n".join(output.rstrip().splitlines()[-lines:])
    if len(tail) > _TAIL_CHARS:
        tail = "..." + tail[-_TAIL_CHARS:]
    return tail


class BundleError(Exception):
    """Base class: the bundle could not be built. ``str(exc)`` is the whole story."""


class ProjectLayoutError(BundleError):
    """The code directory is not a bundleable project.

    Raised before anything is built: the directory or its ``pyproject.toml`` is
    missing or unreadable, it holds no importable package or more than one, or a
    directory symlink points out of the project.
    """


class EntryPointError(BundleError):
    """A ``module:attr`` ref (workflow, grader or a config) does not resolve.

    The ref is malformed, names a module outside the project's package, names a
    module file that does not exist or does not parse, or the module defines no
    top-level name ``attr``.
    """

    def __init__(self, field: str, ref: str, problem: str) -> None:
        self.field = field
        self.ref = ref
        super().__init__(f"{field} ref {ref!r}: {problem}")


class BundleBuildError(BundleError):
    """Building a wheel failed; the message ends with the tail of the build output.

    Raised when the project's build backend fails (a broken ``pyproject.toml`` or
    ``setup.py``, a build requirement that cannot be installed), when the built
    wheel does not contain the project's package, or when the ``build`` frontend
    itself is missing.
    """

    def __init__(self, message: str, *, output: str = "") -> None:
        self.output = output
        if output.strip():
            message = f"{message}\n--- last lines of the build output ---\n{output_tail(output)}"
        super().__init__(message)


class DependencyDownloadError(BundleError):
    """The dependency wheels for the container could not be collected.

    ``pip download`` failed (no wheel of a dependency for the container's Python
    and platform, a version that does not exist, no route to the package index)
    or a dependency stayed unresolved; the message ends with pip's output tail.
    """

    def __init__(self, message: str, *, output: str = "") -> None:
        self.output = output
        if output.strip():
            message = f"{message}\n--- last lines of pip's output ---\n{output_tail(output)}"
        super().__init__(message)


def rel(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` when it is inside it, for short messages."""
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)
