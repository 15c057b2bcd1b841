"""Checks a workflow project before anything is built, and lists its files.

Everything here is static (``tomllib`` and ``ast``, no import of user code), so
it is cheap enough to run on every ``build_bundle`` call, cache hits included,
and it never needs the project's dependencies installed on the host.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from harbor_exec.bundler.errors import EntryPointError, ProjectLayoutError, rel

__all__ = [
    "EXCLUDED_DIRS",
    "Project",
    "check_ref",
    "iter_project_files",
    "load_project",
    "module_file",
    "tree_digest",
]

# Never part of a build input: VCS data, virtualenvs, caches and earlier build output.
EXCLUDED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".venv",
        "venv",
        ".tox",
        ".nox",
        "__pycache__",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        "node_modules",
        "dist",
        "build",
    }
)
_EXCLUDED_SUFFIXES = (".pyc", ".pyo", ".egg-info")

# Directories that are not the project's package even with an __init__.py
# (the same idea as setuptools' flat-layout auto-discovery).
_NOT_PACKAGES = frozenset(
    {
        "test",
        "tests",
        "unit_tests",
        "doc",
        "docs",
        "example",
        "examples",
        "script",
        "scripts",
        "tools",
        "benchmark",
        "benchmarks",
        "bench",
        "site_scons",
    }
)

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_REF = re.compile(rf"^(?P<module>{_DOTTED}):(?P<attr>{_DOTTED})$")


@dataclass(frozen=True, slots=True)
class Project:
    """A validated project: where it is and which package it ships."""

    root: Path
    pyproject: Path
    package: str
    package_dir: Path  # the directory holding <package>/__init__.py
    name: str | None  # [project].name, when static


def _excluded(name: str) -> bool:
    return name in EXCLUDED_DIRS or name.endswith(_EXCLUDED_SUFFIXES)


def iter_project_files(root: Path) -> Iterator[tuple[str, Path]]:
    """Yield ``(posix relative path, path)`` of every build input, sorted.

    Directory symlinks are refused: following them could pull files from
    anywhere on the host into the bundle (and into its cache key).
    """
    stack = [root]
    found: list[tuple[str, Path]] = []
    while stack:
        current = stack.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                if _excluded(entry.name):
                    continue
                path = Path(entry.path)
                if entry.is_dir(follow_symlinks=False):
                    stack.append(path)
                elif entry.is_symlink() and path.is_dir():
                    raise ProjectLayoutError(
                        f"{path} is a symlink to a directory; a bundle only takes real files. "
                        "Replace it with a copy or remove it."
                    )
                elif entry.is_file():
                    found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    yield from found


def tree_digest(root: Path) -> str:
    """sha256 over every build input's relative path, executable bit and content."""
    digest = hashlib.sha256()
    for relpath, path in iter_project_files(root):
        data = path.read_bytes()
        executable = os.access(path, os.X_OK)
        digest.update(f"{relpath}\0{int(executable)}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def _packages_in(directory: Path) -> list[str]:
    if not directory.is_dir():
        return []
    found = []
    for child in sorted(directory.iterdir()):
        if (
            child.is_dir()
            and child.name.isidentifier()
            and not child.name.startswith(("_", "."))
            and child.name not in _NOT_PACKAGES
            and not _excluded(child.name)
            and (child / "__init__.py").is_file()
        ):
            found.append(child.name)
    return found


def load_project(code_dir: Path) -> Project:
    """Validate the layout of ``code_dir``: a ``pyproject.toml`` and one package."""
    root = code_dir.expanduser().resolve()
    if not root.is_dir():
        raise ProjectLayoutError(
            f"code directory {code_dir} does not exist or is not a directory; "
            "pass the directory that holds your project's pyproject.toml."
        )
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        raise ProjectLayoutError(
            f"no pyproject.toml in {root}: a workflow project needs one, with a "
            "[build-system] table naming its build backend (e.g. setuptools or hatchling) "
            "and a [project] table with its name, version and dependencies."
        )
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProjectLayoutError(f"{pyproject} is not valid TOML: {exc}; fix it.") from exc
    project_table = data.get("project")
    name = project_table.get("name") if isinstance(project_table, dict) else None

    src_packages = _packages_in(root / "src")
    flat_packages = _packages_in(root)
    if src_packages:
        packages, package_parent, layout = src_packages, root / "src", "src/"
    else:
        packages, package_parent, layout = flat_packages, root, ""
    if not packages:
        raise ProjectLayoutError(
            f"no importable package in {root}: expected one directory with an __init__.py, "
            "either at the top level (flat layout) or under src/ (src layout); directories "
            f"named {', '.join(sorted(_NOT_PACKAGES))} never count. "
            "Create <your_package>/__init__.py holding your workflow and grader."
        )
    if len(packages) > 1:
        listed = ", ".join(f"{layout}{p}/" for p in packages)
        raise ProjectLayoutError(
            f"{len(packages)} top-level packages in {root} ({listed}); a bundle ships exactly "
            "one. Move the others inside your main package, or out of the project."
        )
    if src_packages and flat_packages:
        listed = ", ".join(f"{p}/" for p in flat_packages)
        raise ProjectLayoutError(
            f"{root} has packages both under src/ ({src_packages[0]}/) and at the top level "
            f"({listed}); a bundle ships exactly one. Keep one layout."
        )
    package = packages[0]
    return Project(
        root=root,
        pyproject=pyproject,
        package=package,
        package_dir=package_parent / package,
        name=name if isinstance(name, str) else None,
    )


def module_file(project: Project, module: str) -> Path | None:
    """The file of ``module`` (dotted, inside the package): ``.py`` or ``__init__.py``."""
    parts = module.split(".")[1:]
    if not parts:
        return project.package_dir / "__init__.py"
    base = project.package_dir.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(body: list[ast.stmt]) -> tuple[set[str], bool]:
    """Names bound at module level, and whether the module may define more.

    Looks through ``if``/``try``/``with`` blocks, since those run at import; a
    star import or a module ``__getattr__`` makes the answer open-ended.
    """
    names: set[str] = set()
    open_ended = False

    def targets(node: ast.expr) -> None:
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Tuple | ast.List):
            for element in node.elts:
                targets(element)
        elif isinstance(node, ast.Starred):
            targets(node.value)

    def visit(statements: list[ast.stmt]) -> None:
        nonlocal open_ended
        for node in statements:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    targets(target)
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets(node.target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        open_ended = True
                    else:
                        names.add(alias.asname or alias.name)
            elif isinstance(node, ast.If | ast.For | ast.While):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.With):
                visit(node.body)
            elif isinstance(node, ast.Try | ast.TryStar):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)

    visit(body)
    if "__getattr__" in names:
        open_ended = True
    return names, open_ended


def check_ref(project: Project, field: str, ref: str) -> str:
    """Check statically that ``ref`` (``module:attr``) resolves inside the package.

    Returns the module file's path relative to the project, for messages.
    """
    match = _REF.match(ref)
    if match is None:
        raise EntryPointError(
            field,
            ref,
            "expected the form 'package.module:Name' (a dotted module path, a colon, "
            "and a top-level name in that module).",
        )
    # A dotted attr ("Outer.inner") must start with a top-level name.
    module, attr = match["module"], match["attr"].split(".")[0]
    package = project.package
    if module != package and not module.startswith(package + "."):
        raise EntryPointError(
            field,
            ref,
            f"module {module!r} is outside the project's package {package!r}; "
            f"refs must name a module inside it, e.g. '{package}.workflow:{attr}'.",
        )
    path = module_file(project, module)
    if path is None:
        expected = project.package_dir.joinpath(*module.split(".")[1:])
        raise EntryPointError(
            field,
            ref,
            f"module {module!r} not found: neither {rel(expected.with_suffix('.py'), project.root)}"
            f" nor {rel(expected / '__init__.py', project.root)} exists.",
        )
    where = rel(path, project.root)
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        raise EntryPointError(
            field, ref, f"{where} line {exc.lineno} does not parse: {exc.msg}; fix it."
        ) from exc
    names, open_ended = _top_level_names(tree.body)
    if attr not in names and not open_ended:
        raise EntryPointError(
            field,
            ref,
            f"{where} defines no top-level name {attr!r}; define it at module level "
            "(a class, or a module-level config instance) or fix the ref.",
        )
    return where
