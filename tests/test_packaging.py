"""Packaging: what the wheel installs, and that its declared dependencies cover its imports."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

# Which extra a module's top-level imports may come from, besides the core dependencies
# (the longest matching prefix wins). Imports inside functions may come from any extra:
# they are how a core module uses an extra only when asked to.
EXTRA_OF = {
    "harbor_exec/server/": "server",
    "harbor_exec/client.py": "server",
    "harbor_exec/_client_http.py": "server",
    "harbor_exec/executors/ray/": "ray",
    "harbor_exec/network/": "server",
    "harbor_exec/agents/native/environment.py": "native",
    "bundler/": "bundler",
}
FIRST_PARTY = {"harbor_exec", "bundler"}


def _requirements(group: str | None) -> set[str]:
    project = PYPROJECT["project"]
    specs = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return {canonicalize_name(Requirement(spec).name) for spec in specs}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """Top-level names a module imports at module level, and inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nested: set[int] = set()
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            nested |= {id(node) for node in ast.walk(func)}
    eager: set[str] = set()
    lazy: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        tops = {name.split(".")[0] for name in names}
        (lazy if id(node) in nested else eager).update(tops)
    return eager, lazy


def test_declared_dependencies_cover_every_import() -> None:
    distributions = importlib.metadata.packages_distributions()
    core = _requirements(None)
    extras = {
        name: _requirements(name) for name in ("server", "bundler", "ray", "native", "osmosis")
    }
    missing: list[str] = []
    files = sorted(ROOT.glob("harbor_exec/**/*.py")) + sorted(ROOT.glob("bundler/**/*.py"))
    checked = 0
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("harbor_exec/bundler/"):
            continue  # the symlink to bundler/, read once under that name
        extra = max(
            (prefix for prefix in EXTRA_OF if rel.startswith(prefix)), key=len, default=None
        )
        allowed = core | (extras[EXTRA_OF[extra]] if extra else set())
        anywhere = core.union(*extras.values())
        eager, lazy = _imports(path)
        for names, pool in ((eager, allowed), (lazy, anywhere)):
            for name in sorted(names - FIRST_PARTY - set(sys.stdlib_module_names)):
                checked += 1
                dists = {canonicalize_name(d) for d in distributions.get(name, [])}
                if not dists & pool:
                    where = f"the {EXTRA_OF[extra]} extra" if extra else "the core dependencies"
                    missing.append(f"{rel} imports {name} (from {sorted(dists)}), not in {where}")
    assert checked > 20  # the scan saw the third-party imports (docker, pydantic, fastapi...)
    assert not missing, "\n".join(missing)


@pytest.mark.slow  # a real isolated build: pip installs hatchling from the index
def test_wheel_ships_the_bundler_as_harbor_exec_bundler(tmp_path: Path) -> None:
    out = tmp_path / "dist"
    done = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = out.glob("harbor_exec-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "unpacked")
    tops = {name.split("/")[0] for name in names}
    assert tops == {"harbor_exec", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    sources = {p.relative_to(ROOT / "bundler").as_posix() for p in ROOT.glob("bundler/*.py")}
    shipped = {n.removeprefix("harbor_exec/bundler/") for n in names if "/bundler/" in n}
    assert shipped == sources
    assert "harbor_exec/_images/bootstrap.sh" in names
    # The console's page and the vendored Swagger UI and ReDoc, with their licences.
    assets = "harbor_exec/server/assets/"
    for asset in (
        "index.html", "console.js", "console.css", "favicon.svg",
        "swagger-ui/swagger-ui-bundle.js", "swagger-ui/LICENSE",
        "redoc/redoc.standalone.js", "redoc/LICENSE", "redoc/redoc.standalone.js.LICENSE.txt",
    ):  # fmt: skip
        assert assets + asset in names, asset

    # Import from the unpacked wheel alone: no checkout on sys.path (no site, no .pth
    # files), third-party packages from this environment's site-packages.
    probe = (
        "import importlib.util, sys\n"
        f"sys.path[:0] = [{str(tmp_path / 'unpacked')!r}]\n"
        f"sys.path.append({sysconfig.get_paths()['purelib']!r})\n"
        "import harbor_exec.bundler as b\n"
        "from harbor_exec.bundler.wheels import build_wheel\n"
        "print(b.__file__)\n"
        "print(importlib.util.find_spec('bundler'))\n"
    )
    ran = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    location, top_level = ran.stdout.splitlines()
    assert location == str(tmp_path / "unpacked" / "harbor_exec" / "bundler" / "__init__.py")
    assert top_level == "None"
