"""The house's rules, checked: one spine of imports, a light public face, a sealed container side.

Every import of a ``harbor_exec`` module (at module level or inside a function) must
point to the same part of the package or down the spine below; the code that runs in
task containers imports only the standard library, pydantic and itself; the Docker
SDK stays in its adapter; ``import harbor_exec`` loads nothing but itself.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harbor_exec.bundler import runtime as runtime_module
from harbor_exec.bundler.errors import BundleBuildError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harbor_exec"

# The spine, top to bottom: a part may import its own modules and any part on a
# lower floor, never one above. Parts on one floor do not import each other.
FLOORS: tuple[frozenset[str], ...] = (
    frozenset({"cli"}),
    frozenset({"server"}),
    frozenset({"backends", "jobs"}),
    frozenset({"sources"}),
    frozenset({"executors", "bundler"}),
    frozenset({"trial"}),
    frozenset({"agents"}),
    frozenset({"network"}),
    frozenset({"tasks"}),
    frozenset({"sandbox"}),
    frozenset({"container", "client"}),
    frozenset({"_client_http", "protocol", "compat"}),
    frozenset({"authoring"}),
    frozenset({"errors", "cache"}),
)
FLOOR_OF = {part: level for level, parts in enumerate(FLOORS) for part in parts}
CONTAINER_ALLOWED = {
    "harbor_exec",
    "harbor_exec.authoring",
    "harbor_exec.compat.osmosis",
    "harbor_exec.errors",
    "harbor_exec.protocol",
}


def _modules() -> list[tuple[str, Path]]:
    found = []
    for base in (PACKAGE, ROOT / "bundler"):
        for path in sorted(base.rglob("*.py")):
            if "_buildkit" in path.parts:
                continue  # protoc's output
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[0] == "bundler":
                parts = ["harbor_exec", *parts]
            if parts[-1] == "__init__":
                parts.pop()
            found.append((".".join(parts), path))
    return found


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every harbor_exec import that runs (``TYPE_CHECKING`` ones do not)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in runtime_module._runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return [(line, module) for line, module in out if module.split(".")[0] == "harbor_exec"]


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "harbor_exec"


def test_at_most_ten_top_level_modules() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top


def test_every_part_has_a_floor() -> None:
    parts = {_part(module) for module, _ in _modules()} - {"harbor_exec"}
    assert parts <= set(FLOOR_OF), f"parts without a floor in FLOORS: {parts - set(FLOOR_OF)}"


def test_imports_point_down_the_spine_only() -> None:
    wrong = []
    for module, path in _modules():
        here = _part(module)
        if here == "harbor_exec":
            continue  # the lazy entry points (harbor_exec/__init__.py) import nothing at import
        for line, target in _imports(path):
            there = _part(target)
            if there == here or there == "harbor_exec":
                continue  # a part's own modules; the package's __version__
            if FLOOR_OF[there] <= FLOOR_OF[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({here}) imports {target} ({there})")
    assert not wrong, "imports against the spine:\n" + "\n".join(wrong)


def test_container_side_imports_only_the_standard_library_pydantic_and_itself() -> None:
    third_party = {"pydantic", "pydantic_core", "typing_extensions"}
    wrong = []
    for name in runtime_module.RUNTIME_FILES:
        path = PACKAGE / name
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # The osmosis-ai adapter imports the SDK inside its functions only, when SDK
        # code runs (the SDK is then in the bundle's dependency environment).
        in_functions = {
            id(inner)
            for func in ast.walk(tree)
            if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef)
            for inner in ast.walk(func)
        }
        for node in runtime_module._runtime_nodes(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            for module in names:
                top = module.split(".")[0]
                if top == "harbor_exec":
                    ok = module in CONTAINER_ALLOWED or module.startswith("harbor_exec.container")
                else:
                    ok = top in sys.stdlib_module_names or top in third_party
                    ok = ok or (
                        name == "compat/osmosis.py"
                        and top == "osmosis_ai"
                        and id(node) in in_functions
                    )
                if not ok:
                    wrong.append(f"harbor_exec/{name}:{node.lineno} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_runtime_wheel_check_refuses_a_container_module_that_reaches_the_service() -> None:
    source = b"from harbor_exec.sandbox.docker import DockerRuntime\n"
    with pytest.raises(
        BundleBuildError, match=r"container/runner\.py imports harbor_exec\.sandbox"
    ):
        runtime_module._check_imports("container/runner.py", source)
    with pytest.raises(BundleBuildError, match="relative import"):
        runtime_module._check_imports("container/runner.py", b"from . import exchange\n")
    typing_only = (
        b"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import harbor_exec.server\n"
    )
    runtime_module._check_imports("__init__.py", typing_only)  # never executed: allowed
    for name, data in runtime_module.runtime_source().files:
        runtime_module._check_imports(name, data)  # the real container side passes


def test_ruff_keeps_the_docker_sdk_in_its_adapter() -> None:
    def lint(as_file: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(Path(sys.executable).parent / "ruff"), "check", "--stdin-filename", as_file, "-"],
            input="import docker\n\nprint(docker)\n",
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
        )

    outside = lint("harbor_exec/trial/probe.py")
    assert outside.returncode != 0 and "TID251" in outside.stdout, outside.stdout
    assert lint("harbor_exec/sandbox/docker.py").returncode == 0


def test_ci_runs_the_checks_before_the_tests() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    steps = [line for line in ci if line and not line.startswith(("#", "set ", "cd ", "export "))]
    assert steps == [
        "./scripts/setup.sh",
        "./scripts/check.sh",
        ".venv/bin/python -m pytest -q",
    ], steps
    check = (ROOT / "scripts" / "check.sh").read_text(encoding="utf-8")
    for command in ('"$PY/mypy"', '"$PY/ruff" check .', '"$PY/ruff" format --check .'):
        assert command in check
    assert "set -euo pipefail" in check  # any failing check fails CI
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "./scripts/check.sh" in readme and ".venv/bin/python -m pytest -q" in readme


def test_entry_points_import_lazily_from_the_top() -> None:
    probe = (
        "import sys, harbor_exec\n"
        "heavy = {'docker', 'fastapi', 'harbor_exec.server', 'harbor_exec.backends'}\n"
        "assert not heavy & set(sys.modules), sorted(heavy & set(sys.modules))\n"
        "from harbor_exec import (HarborBackend, LocalBackend, RolloutClient,\n"
        "    create_rollout_server, AgentWorkflow, Grader, GraderContext,\n"
        "    AgentWorkflowContext, RolloutSample)\n"
        "from harbor_exec.backends.harbor.backend import HarborBackend as H\n"
        "assert HarborBackend is H\n"
        "print(sorted(set(harbor_exec.__all__) - set(dir(harbor_exec))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- Inside a part: no import circles, no reaching into another module's private names,
# and a row in docs/architecture.md for every part and subfolder. ---

MODULES = dict(_modules())
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"


def _target_modules(node: ast.Import | ast.ImportFrom) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) for one import of harbor_exec, submodules resolved."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names if alias.name in MODULES]
    if node.level or not node.module or node.module not in MODULES:
        return []
    out: list[tuple[str, list[str]]] = []
    names = []
    for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        if sub in MODULES:
            out.append((sub, []))  # `from package import submodule`
        else:
            names.append(alias.name)
    if names:
        out.append((node.module, names))
    return out


def _all_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """Every harbor_exec import in a file: module level, in functions, under TYPE_CHECKING."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (node.lineno, module, names)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for module, names in _target_modules(node)
    ]


def _circles_inside_parts() -> set[frozenset[str]]:
    """The strongly connected groups (more than one module) of each part's import graph."""
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for module, path in MODULES.items():
        for _, target, _ in _all_imports(path):
            if target != module and _part(target) == _part(module) != "harbor_exec":
                graph[module].add(target)
    # Tarjan's algorithm, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: set[frozenset[str]] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.add(frozenset(group))
    return groups


def test_no_import_circles_inside_a_part() -> None:
    new = _circles_inside_parts()
    assert not new, "import circles inside a part (TYPE_CHECKING imports included):\n" + "\n".join(
        " <-> ".join(sorted(group)) for group in new
    )


def _private_accesses() -> set[tuple[str, str]]:
    """(module, "other.module._name") for each use of another module's private name."""
    found: set[tuple[str, str]] = set()
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bound: dict[str, str] = {}  # local name -> the harbor_exec module it is bound to
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target, names in _target_modules(node):
                if target == module:
                    continue
                for name in names:
                    if name.startswith("_") and not name.startswith("__"):
                        found.add((module, f"{target}.{name}"))
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in MODULES:
                        bound[alias.asname] = alias.name
            elif node.module and not node.level:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if sub in MODULES:
                        bound[alias.asname or alias.name] = sub
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and bound[node.value.id] != module
                and f"{bound[node.value.id]}.{node.attr}" not in MODULES
            ):
                found.add((module, f"{bound[node.value.id]}.{node.attr}"))
    return found


def test_no_module_touches_another_modules_private_names() -> None:
    new = sorted(_private_accesses())
    assert not new, "private names used from another module:\n" + "\n".join(
        f"{module} uses {name}" for module, name in new
    )


def test_every_part_and_subfolder_has_its_row_in_the_map() -> None:
    rows = [
        line
        for line in ARCHITECTURE_DOC.read_text(encoding="utf-8").splitlines()
        if line.startswith("|")
    ]
    named = {token for line in rows for token in re.findall(r"`([^`]+)`", line)}
    missing = []
    for base, prefix in ((PACKAGE, ""), (ROOT / "bundler", "bundler/")):
        for folder in sorted(p for p in base.rglob("*") if p.is_dir()):
            rel = folder.relative_to(base).as_posix()
            if "__pycache__" in rel or "_buildkit" in rel or not any(folder.glob("*.py")):
                continue
            if f"{prefix}{rel}/" not in named:
                missing.append(f"{prefix}{rel}/")
    for module in PACKAGE.glob("*.py"):
        if module.name != "__init__.py" and module.name not in named:
            missing.append(module.name)
    if "bundler/" not in named:
        missing.append("bundler/")
    assert not missing, f"parts or folders without a row in docs/architecture.md: {missing}"


def test_the_maps_floor_table_is_the_spine() -> None:
    """Each part in docs/architecture.md's floor table sits on the floor FLOORS gives it."""
    documented: dict[str, int] = {}
    for line in ARCHITECTURE_DOC.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        for token in re.findall(r"`([^`]+)`", cells[1]):
            part = token.removesuffix("/").removesuffix(".py").split("/")[0]
            documented.setdefault(part, int(cells[0]) - 1)
    assert documented == {part: FLOOR_OF[part] for part in documented}
    assert set(documented) == set(FLOOR_OF), set(FLOOR_OF) ^ set(documented)


def test_readme_is_a_front_page_whose_links_all_resolve() -> None:
    """README.md stays short; every relative link in it and in docs/ names a file that exists
    (and, with an anchor, a heading of that file)."""
    readme = ROOT / "README.md"
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= 250
    broken = []
    for page in [readme, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"(https?:|mailto:)", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md":
                headings = {
                    re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                    for line in linked.read_text(encoding="utf-8").splitlines()
                    if line.startswith("#")
                }
                if anchor not in headings:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
