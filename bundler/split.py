"""The two parts of a bundle: what the agent's container may hold, found statically.

The agent's container gets the user's wheel without the modules of the ``grader``
and ``grader_config`` refs (the grader's copy, in the verifier, gets all of it). That
only works when nothing the workflow imports is one of those modules, so the
bundler works out the *agent side*: the modules of the ``workflow`` and
``workflow_config`` refs, the package ``__init__`` chain of each, and every module
of the user's package they import, transitively (``import pkg.a``, ``from pkg
import a``, ``from .a import b``, ``from .. import c``; anywhere in a module, a
function body included, except under ``if TYPE_CHECKING:``). A grader ref whose
module is on that side (osmosis-ai's usual layout: everything in one module) stays in
the agent's part, said once at bundling (``exposed``); strict grader isolation refuses
it with :class:`GraderSplitError`.

Like the rest of the project checks this is ``ast`` only: no user code runs.
Imports made at run time (``importlib.import_module``, ``__import__``) are not
seen; inside the agent's container they find no grader module to import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from harbor_exec.bundler.errors import GraderSplitError, ProjectLayoutError, rel
from harbor_exec.bundler.project import Project, module_file

__all__ = [
    "AGENT_FIELDS",
    "GRADER_FIELDS",
    "AgentSide",
    "GraderSplit",
    "agent_side",
    "grader_split",
    "split_bundle",
]

#: The refs whose modules the agent's container runs, and those it never holds.
AGENT_FIELDS = ("workflow", "workflow_config")
GRADER_FIELDS = ("grader", "grader_config")


@dataclass(frozen=True, slots=True)
class _Reached:
    """How the agent side reached a module: ``via`` imported it (None: a ref's module
    or a package of one, named in ``root``)."""

    via: str | None
    root: str


@dataclass(frozen=True, slots=True)
class AgentSide:
    """The modules of the user's package the agent's side of a bundle imports."""

    modules: Mapping[str, _Reached]

    def path_to(self, module: str) -> str:
        """Why ``module`` is on the agent side, in words, for the error message."""
        steps = [module]
        reached = self.modules[module]
        while reached.via is not None:
            steps.append(reached.via)
            reached = self.modules[reached.via]
        steps.reverse()
        if len(steps) == 1:
            return f"{module} is {reached.root}"
        chain = ", which imports ".join(steps[1:])
        return f"{steps[0]} ({reached.root}) imports {chain}"


def _chain(module: str) -> list[str]:
    """``a.b.c`` -> ``[a, a.b, a.b.c]``: every module importing ``a.b.c`` runs."""
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, skipping ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                if isinstance(other, ast.Import | ast.ImportFrom):
                    yield other
                else:
                    yield from _import_nodes(other)
        else:
            yield from _import_nodes(child)


def _star_names(tree: ast.Module) -> list[str]:
    """The literal strings of a module's ``__all__`` (a star import takes those)."""
    names: list[str] = []
    for node in tree.body:
        value: ast.expr | None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        if isinstance(value, ast.List | ast.Tuple):
            for element in value.elts:
                if isinstance(element, ast.Constant) and isinstance(element.value, str):
                    names.append(element.value)
    return names


class _Graph:
    """Parses the package's modules on demand, once each."""

    def __init__(self, project: Project) -> None:
        self.project = project
        self._trees: dict[Path, ast.Module] = {}

    def tree(self, path: Path, *, module: str) -> ast.Module:
        if path not in self._trees:
            try:
                self._trees[path] = ast.parse(path.read_bytes(), filename=str(path))
            except SyntaxError as exc:
                raise ProjectLayoutError(
                    f"{rel(path, self.project.root)} line {exc.lineno} does not parse: "
                    f"{exc.msg}; fix it (the workflow's side of the bundle imports "
                    f"{module})."
                ) from exc
        return self._trees[path]

    def inside(self, module: str) -> bool:
        package = self.project.package
        return module == package or module.startswith(package + ".")

    def imported_by(self, module: str, path: Path) -> list[str]:
        """The modules of the package that importing ``module`` (file ``path``) imports."""
        tree = self.tree(path, module=module)
        is_package = path.name == "__init__.py"
        found: list[str] = []
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                found += [alias.name for alias in node.names]
                continue
            if node.level:
                parts = module.split(".")
                if not is_package:
                    parts = parts[:-1]
                up = node.level - 1
                if up >= len(parts):
                    continue  # beyond the top-level package: an ImportError at run time
                parts = parts[: len(parts) - up]
                if node.module:
                    parts += node.module.split(".")
                base = ".".join(parts)
            elif node.module:
                base = node.module
            else:
                continue
            found.append(base)
            for alias in node.names:
                if alias.name != "*":
                    found.append(f"{base}.{alias.name}")  # a submodule, when it is one
                    continue
                base_file = module_file(self.project, base) if self.inside(base) else None
                if base_file is not None and base_file.name == "__init__.py":
                    star = self.tree(base_file, module=base)
                    found += [f"{base}.{name}" for name in _star_names(star)]
        return [name for name in found if self.inside(name)]


def agent_side(project: Project, refs: Mapping[str, str | None]) -> AgentSide:
    """The modules the ``workflow`` and ``workflow_config`` refs import, transitively."""
    graph = _Graph(project)
    modules: dict[str, _Reached] = {}
    queue: list[str] = []

    def reach(module: str, reached: _Reached) -> None:
        if module not in modules and module_file(project, module) is not None:
            modules[module] = reached
            queue.append(module)

    for field in AGENT_FIELDS:
        ref = refs.get(field)
        if ref is None:
            continue
        module = ref.split(":", 1)[0]
        for package in _chain(module)[:-1]:
            reach(package, _Reached(None, f"a package of {module}, the {field} ref's module"))
        reach(module, _Reached(None, f"the module of the {field} ref {ref!r}"))
    while queue:
        module = queue.pop(0)  # breadth first: the shortest chain is the one reported
        path = module_file(project, module)
        assert path is not None
        for name in graph.imported_by(module, path):
            for step in _chain(name):
                reach(step, _Reached(module, ""))
    return AgentSide(modules)


@dataclass(frozen=True, slots=True)
class GraderSplit:
    """How a bundle splits: the wheel paths only the grader's part holds (a module file,
    or a package directory ending in ``/``), sorted; and, one line each, the grader refs
    whose module the workflow's side imports (the agent's container holds those)."""

    grader_only: list[str]
    exposed: list[str]


def grader_split(project: Project, refs: Mapping[str, str | None]) -> GraderSplit:
    """Split ``refs``' modules between the agent's part and the grader's. A grader ref in
    a module the workflow's side imports (osmosis-ai's usual layout: workflow, grader
    and configs in one module) stays in the agent's part and is listed in ``exposed``;
    the grader still runs only in the verifier's container."""
    side = agent_side(project, refs)
    exposed: list[str] = []
    grader_only: set[str] = set()
    for field in GRADER_FIELDS:
        ref = refs.get(field)
        if ref is None:
            continue
        module = ref.split(":", 1)[0]
        if module in side.modules:
            exposed.append(
                f"{field} ref {ref!r} is in module {module!r}, which the workflow's side "
                f"imports: {side.path_to(module)}"
            )
            continue
        path = module_file(project, module)
        assert path is not None  # check_ref found it
        in_wheel = path.relative_to(project.package_dir.parent).as_posix()
        if path.name == "__init__.py":  # a package: every submodule runs it, so all are its
            in_wheel = in_wheel.removesuffix("__init__.py")
        grader_only.add(in_wheel)
    return GraderSplit(sorted(grader_only), exposed)


def split_bundle(project: Project, refs: Mapping[str, str | None]) -> list[str]:
    """The wheel paths only the grader's part of the bundle holds; refuses refs that
    cannot be kept out of the agent's container (strict grader isolation)."""
    split = grader_split(project, refs)
    if split.exposed:
        raise GraderSplitError(split.exposed, package=project.package)
    return split.grader_only
