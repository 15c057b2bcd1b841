"""``load_bundle``: a prebuilt bundle given by path (``HarborBackend(bundle=...)``).

Three shapes are accepted:

- a bundle directory written by ``build_bundle`` / ``harbor-exec bundle`` (it holds
  ``manifest.json``);
- the project wheel inside one (``<root>/wheel/<name>.whl``, what ``harbor-exec bundle``
  prints as ``wheel``): the bundle around it is used, after checking its digest;
- a bundle wheel built by osmosis-ai's SDK (``osmosis_ai.packaging.build_bundle``). Such
  a wheel names its refs only in the generated ``<package>/bundle_main.py`` and carries
  no wheelhouse, so it is unpacked into a project (its package, its ``Requires-Dist``) and
  bundled here with those refs: the same code and dependencies, our wheelhouse and
  runtime (cached by content like any bundle).

Anything else is refused with a ``BundleError`` naming the path.
"""

from __future__ import annotations

import ast
import email.parser
import json
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from harbor_exec.bundler.bundle import Bundle, build_bundle, bundle_from
from harbor_exec.bundler.errors import BundleError
from harbor_exec.bundler.manifest import MANIFEST_NAME, Manifest
from harbor_exec.bundler.wheels import sha256_file

__all__ = ["check_bundle_path", "load_bundle", "osmosis_bundle_refs"]

#: The shim osmosis-ai's bundler writes into the package, and its import aliases.
_OSMOSIS_SHIM = "bundle_main.py"
_OSMOSIS_ALIASES = {
    "_osmosis_workflow": "workflow",
    "_osmosis_grader": "grader",
    "_osmosis_workflow_config": "workflow_config",
    "_osmosis_grader_config": "grader_config",
}


def load_bundle(
    path: str | Path, *, cache_dir: Path | None = None, strict_grader_isolation: bool = False
) -> Bundle:
    """The bundle at ``path`` (see the module doc); ``cache_dir`` and
    ``strict_grader_isolation`` as ``build_bundle``'s."""
    given = Path(path).expanduser()
    root = _harbor_exec_root(given)
    if root is not None:
        return _bundle_dir(root, given)
    return _from_osmosis_wheel(given, cache_dir, strict_grader_isolation)


def check_bundle_path(path: str | Path) -> None:
    """Refuse, cheaply (no build), a path ``load_bundle`` would refuse: a BundleError
    naming it. A harbor-exec bundle's digest is checked later, by ``load_bundle``."""
    given = Path(path).expanduser()
    root = _harbor_exec_root(given)
    if root is None and osmosis_bundle_refs(given) is None:
        raise BundleError(_not_a_bundle(given))
    if root is not None and not (root / MANIFEST_NAME).is_file():
        raise BundleError(f"bundle {given}: the directory has no {MANIFEST_NAME}")


def _harbor_exec_root(given: Path) -> Path | None:
    """The harbor-exec bundle directory ``given`` is, or holds the wheel of; None for a
    wheel that is not in one. BundleError when ``given`` is neither a directory nor a
    wheel."""
    if given.is_dir():
        return given
    if not given.is_file():
        raise BundleError(f"bundle {given}: no such file or directory")
    if given.suffix != ".whl" or not zipfile.is_zipfile(given):
        raise BundleError(
            f"bundle {given} is neither a bundle directory (with {MANIFEST_NAME}) nor a wheel"
        )
    root = given.resolve().parent.parent
    return root if (root / MANIFEST_NAME).is_file() else None


def _not_a_bundle(wheel: Path) -> str:
    return (
        f"bundle {wheel} is not a bundle: no {MANIFEST_NAME} beside it (a harbor-exec "
        f"bundle) and no {_OSMOSIS_SHIM} runner shim (an osmosis-ai bundle wheel)"
    )


def _bundle_dir(root: Path, given: Path) -> Bundle:
    try:
        manifest = Manifest.read(root / MANIFEST_NAME)
    except FileNotFoundError:
        raise BundleError(
            f"bundle {given}: the directory has no {MANIFEST_NAME} (build one with "
            "`harbor-exec bundle` or build_bundle)"
        ) from None
    except (OSError, ValueError) as exc:
        raise BundleError(f"bundle {given}: unreadable {MANIFEST_NAME}: {exc}") from None
    bundle = bundle_from(root.resolve(), manifest, cached=True)
    if given.is_file() and given.resolve() != bundle.wheel.resolve():
        raise BundleError(
            f"bundle {given}: {root / MANIFEST_NAME} names the wheel "
            f"{manifest.wheel.filename}, not this one"
        )
    if not bundle.wheel.is_file() or sha256_file(bundle.wheel) != manifest.wheel.sha256:
        raise BundleError(
            f"bundle {given}: the wheel {bundle.wheel} is missing or does not match its "
            f"{MANIFEST_NAME} (sha256); build the bundle again"
        )
    return bundle


def osmosis_bundle_refs(wheel: Path) -> dict[str, str | None] | None:
    """The refs an osmosis-ai bundle wheel was built with, or None when it is none."""
    with zipfile.ZipFile(wheel) as archive:
        shims = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(_OSMOSIS_SHIM)]
        entry_points = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        if len(shims) != 1 or not entry_points:
            return None
        scripts = archive.read(entry_points[0]).decode("utf-8", "replace")
        if ".bundle_main:agent_main" not in scripts and ".bundle_main:grader_main" not in scripts:
            return None
        source = archive.read(shims[0]).decode("utf-8")
    refs: dict[str, str | None] = dict.fromkeys(_OSMOSIS_ALIASES.values())
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                label = _OSMOSIS_ALIASES.get(alias.asname or "")
                if label is not None:
                    refs[label] = f"{node.module}:{alias.name}"
    if refs["workflow"] is None and refs["grader"] is None:
        return None
    return refs


def _from_osmosis_wheel(wheel: Path, cache_dir: Path | None, strict: bool) -> Bundle:
    refs = osmosis_bundle_refs(wheel)
    if refs is None:
        raise BundleError(_not_a_bundle(wheel))
    with tempfile.TemporaryDirectory(prefix="harbor-exec-osmosis-bundle-") as tmp:
        project = Path(tmp) / "project"
        _unpack_as_project(wheel, project)
        return build_bundle(
            project,
            workflow=refs["workflow"],
            grader=refs["grader"],
            workflow_config=refs["workflow_config"],
            grader_config=refs["grader_config"],
            cache_dir=cache_dir,
            strict_grader_isolation=strict,
        )


def _unpack_as_project(wheel: Path, project: Path) -> None:
    """The wheel's package (less osmosis-ai's shim) under ``src/``, and a setuptools
    ``pyproject.toml`` with its name, version, Python and non-extra requirements."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_names = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        if len(metadata_names) != 1:
            raise BundleError(f"bundle {wheel}: the wheel has no single .dist-info/METADATA")
        metadata = email.parser.Parser().parsestr(archive.read(metadata_names[0]).decode())
        for info in archive.infolist():
            name = info.filename
            top = name.split("/", 1)[0]
            if info.is_dir() or top.endswith((".dist-info", ".data")):
                continue
            if name.count("/") == 1 and name.endswith(_OSMOSIS_SHIM):
                continue  # osmosis-ai's runner shim: our runner reads the manifest instead
            dest = (project / "src" / name).resolve()
            if not dest.is_relative_to((project / "src").resolve()):
                raise BundleError(f"bundle {wheel}: the entry {name!r} leaves the wheel's root")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(archive.read(info))
    dependencies: list[str] = []
    for spec in metadata.get_all("Requires-Dist") or []:
        try:
            requirement = Requirement(spec)
        except InvalidRequirement:
            raise BundleError(f"bundle {wheel}: unreadable Requires-Dist {spec!r}") from None
        if requirement.marker is not None and "extra" in str(requirement.marker):
            continue  # osmosis-ai's inspect_bundle drops extra-gated requirements too
        dependencies.append(str(requirement))
    # JSON strings are valid TOML basic strings.
    lines = [
        "[build-system]",
        'requires = ["setuptools>=68"]',
        'build-backend = "setuptools.build_meta"',
        "",
        "[project]",
        f"name = {json.dumps(metadata.get('Name', 'bundle'))}",
        f"version = {json.dumps(metadata.get('Version', '0'))}",
        f"dependencies = {json.dumps(dependencies)}",
    ]
    if requires_python := metadata.get("Requires-Python"):
        lines.append(f"requires-python = {json.dumps(requires_python)}")
    lines += [
        "",
        "[tool.setuptools.packages.find]",
        'where = ["src"]',
        "",
        "[tool.setuptools.package-data]",
        '"*" = ["**/*"]',
    ]
    (project / "pyproject.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")
