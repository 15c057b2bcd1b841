"""Every error the bundler raises, in one place.

Each class says in its docstring when it happens; each message names the file or
ref at fault and what to do about it, so that ``harbor-exec bundle`` can print it
as is and a backend can put it in a rollout's ``err_message`` before any container
starts.
"""

from __future__ import annotations

from pathlib import Path

from harbor_exec.errors import HarborExecError

__all__ = [
    "BundleBuildError",
    "BundleError",
    "DependencyDownloadError",
    "EntryPointError",
    "GraderSplitError",
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


class BundleError(HarborExecError):
    """Base class: the bundle could not be built. ``str(exc)`` is the whole story."""


class ProjectLayoutError(BundleError):
    """The code directory is not a bundleable project.

    Raised before anything is built: the directory or its ``pyproject.toml`` is
    missing or unreadable, it holds no importable package or more than one, a
    directory symlink points out of the project, or a module the workflow's side
    imports does not parse.
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


class GraderSplitError(BundleError):
    """The grader (or its config) is in a module the workflow's side imports.

    The agent's container gets the bundle without the modules of the ``grader`` and
    ``grader_config`` refs, so neither may be the module of the ``workflow`` or
    ``workflow_config`` ref, a package ``__init__`` of one, or anything they import
    inside the package. ``problems`` has one line per offending ref, each naming its
    module and the chain of imports that reaches it.
    """

    def __init__(self, problems: list[str], *, package: str) -> None:
        self.problems = problems
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            "the grader cannot be kept out of the agent's container:\n"
            f"{listed}\n"
            "The grader and its config never enter the agent's container. Put them in their "
            f"own module (e.g. '{package}.grader:MyGrader' and '{package}.grader:grader_config')"
            " that the workflow and its config do not import, directly or through other "
            "modules; the grader's module may import the workflow's."
        )


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
