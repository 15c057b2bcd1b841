"""``build_bundle``: a workflow project -> wheel + wheelhouse + manifest, cached.

Steps, each failing with a named error before the next starts:

1. validate the project statically (layout, each ``module:attr`` ref, and that the
   grader's modules are apart from the workflow's: ``split.py``);
2. hash every input; a bundle already published under that digest is returned as is;
3. build the project's wheel from a staged copy with ``build`` (its own backend),
   or reuse the wheel already built from the same tree (a change of refs or of
   the container's Python alone does not rebuild it);
4. collect the dependency wheels for the container (keyed by the requirement
   set, so a change of user code alone reuses them) plus harbor-exec's runtime;
5. write ``manifest.json`` and publish the bundle directory atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from pydantic import ValidationError

from harbor_exec.bundler.cache import default_cache_dir, entry_lock, publish, work_dir
from harbor_exec.bundler.errors import BundleBuildError, BundleError, GraderSplitError
from harbor_exec.bundler.manifest import MANIFEST_FORMAT_VERSION, MANIFEST_NAME, Manifest, WheelFile
from harbor_exec.bundler.project import (
    Project,
    check_ref,
    iter_project_files,
    load_project,
    tree_digest,
)
from harbor_exec.bundler.runtime import (
    RUNTIME_DISTRIBUTION,
    RuntimeSource,
    ensure_runtime_wheel,
    runtime_source,
)
from harbor_exec.bundler.split import grader_split
from harbor_exec.bundler.wheels import (
    DEFAULT_PLATFORM,
    Target,
    build_wheel,
    copy_or_link,
    download_wheels,
    read_wheel,
    sha256_file,
    target_requirements,
)
from harbor_exec.container.exchange import RUNTIME_PYTHON_VERSION

__all__ = ["Bundle", "build_bundle"]

# Bump when the bundle's layout or the meaning of its digests changes.
_BUNDLE_SCHEMA = 1
# Provided by the runtime wheel; a project that declares harbor-exec must not
# make pip fetch the full service (or a same-named project) into the container.
_PROVIDED = frozenset({canonicalize_name("harbor-exec"), canonicalize_name(RUNTIME_DISTRIBUTION)})
_PYTHON_VERSION = re.compile(r"^3\.(\d+)$")


@dataclass(frozen=True, slots=True)
class Bundle:
    """A built bundle on disk (everything under ``root`` is immutable)."""

    root: Path
    wheel: Path  # root/wheel/<the project's wheel>
    wheelhouse: Path  # root/wheelhouse/: the dependency layer's complete install set
    manifest: Manifest
    digest: str  # inputs digest: the cache key
    requirements_digest: str  # keys the dependency layer
    cached: bool = False  # True when this call reused a published bundle

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME


def bundle_from(root: Path, manifest: Manifest, *, cached: bool) -> Bundle:
    return Bundle(
        root=root,
        wheel=root / "wheel" / manifest.wheel.filename,
        wheelhouse=root / "wheelhouse",
        manifest=manifest,
        digest=manifest.inputs_digest,
        requirements_digest=manifest.requirements_digest,
        cached=cached,
    )


def _digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _inputs_digest(
    tree: str,
    refs: dict[str, str | None],
    grader_only: list[str],
    target: Target,
    runtime: RuntimeSource,
) -> str:
    return _digest(
        {
            "schema": _BUNDLE_SCHEMA,
            "tree": tree,
            "refs": refs,
            # What the agent's part leaves out (derived from tree and refs; here, bundles
            # made before the split have other digests and are never reused).
            "grader_only": grader_only,
            "python_version": target.python_version,
            "platform_tags": target.tags,
            "runtime": runtime.digest,
        }
    )


def _check_target(python_version: str, platform: str) -> Target:
    match = _PYTHON_VERSION.match(python_version)
    if match is None or int(match[1]) < 11:
        raise BundleError(
            f"python_version {python_version!r}: give the container's Python as 'X.Y', "
            "3.11 or newer (the container runner needs Python >= 3.11)."
        )
    if not platform or any(c.isspace() for c in platform):
        raise BundleError(
            f"platform {platform!r}: give a wheel platform tag, e.g. {DEFAULT_PLATFORM!r}."
        )
    return Target(python_version, platform)


def build_bundle(
    code_dir: str | Path,
    *,
    workflow: str | None,
    grader: str | None = None,
    workflow_config: str | None = None,
    grader_config: str | None = None,
    python_version: str = RUNTIME_PYTHON_VERSION,
    platform: str = DEFAULT_PLATFORM,
    cache_dir: Path | None = None,
    strict_grader_isolation: bool = False,
) -> Bundle:
    """Build (or reuse) the bundle of the project in ``code_dir``.

    ``workflow``, ``grader`` and the configs are ``module:attr`` refs into the
    project's package. ``python_version`` and ``platform`` describe the container's
    Python (default: the read-only runtime's CPython, Debian trixie's, on x86_64; trials
    run only bundles made for it; every manylinux
    tag down to the oldest glibc is accepted). ``cache_dir`` defaults to
    ``<harbor-exec cache>/bundles`` (``$HARBOR_EXEC_CACHE_DIR/bundles``, else
    ``~/.cache/harbor-exec/bundles``).

    The agent's container gets the bundle without the modules of the grader and its
    config, when the workflow's side does not import them. In one module with the
    workflow (osmosis-ai's usual layout) they stay in the agent's part, said once in
    the log by name (the grader still runs only in the verifier's container);
    ``strict_grader_isolation`` refuses such a project instead
    (:class:`bundler.errors.GraderSplitError`).

    ``workflow`` None makes a grader-only bundle (for an agent that is not a workflow,
    such as one of Harbor's own): it then needs a ``grader``.

    Raises a :class:`bundler.errors.BundleError` subclass naming what to fix.
    """
    if workflow is None and grader is None:
        raise ValueError("a bundle needs a workflow, a grader or both")
    project = load_project(Path(code_dir))
    refs = {
        "workflow": workflow,
        "grader": grader,
        "workflow_config": workflow_config,
        "grader_config": grader_config,
    }
    for field, ref in refs.items():
        if ref is not None:
            check_ref(project, field, ref)
    split = grader_split(project, refs)
    if split.exposed:
        if strict_grader_isolation:
            raise GraderSplitError(split.exposed, package=project.package)
        _say_exposed(project, refs, split.exposed)
    grader_only = split.grader_only
    target = _check_target(python_version, platform)
    runtime = runtime_source()
    cache = (cache_dir or default_cache_dir()).expanduser().resolve()

    digest = _inputs_digest(tree_digest(project.root), refs, grader_only, target, runtime)
    root = cache / "bundles" / digest[:32]
    cached = _load_cached(root)
    if cached is not None:
        return cached
    with entry_lock(cache, "bundle", digest):
        # Another process may have built it while this one waited.
        return _load_cached(root) or _build(project, refs, target, runtime, cache)


logger = logging.getLogger("harbor_exec.bundler")
#: The projects (root and refs) whose shared grader module was already said.
_SAID: set[str] = set()


def _say_exposed(project: Project, refs: dict[str, str | None], exposed: list[str]) -> None:
    """Once a process: the grader's module is one the agent's container holds, by name,
    and how to keep it out."""
    key = json.dumps([str(project.root), refs], sort_keys=True)
    if key in _SAID:
        return
    _SAID.add(key)
    listed = "; ".join(exposed)
    logger.warning(
        "the agent's container can read the grader's source: %s. The grader still runs only "
        "in the verifier's container. To keep it out, put the grader and its config in their "
        "own module (e.g. '%s.grader:MyGrader') that the workflow does not import; "
        "strict_grader_isolation=True (--strict-grader-isolation) refuses such a project.",
        listed,
        project.package,
    )


def _load_cached(root: Path) -> Bundle | None:
    manifest_path = root / MANIFEST_NAME
    try:
        manifest = Manifest.read(manifest_path)
    except FileNotFoundError:
        return None
    except (OSError, ValidationError):
        # Published entries are immutable, so an unreadable one is damage:
        # remove it and rebuild rather than fail on every call.
        shutil.rmtree(root, ignore_errors=True)
        return None
    return bundle_from(root, manifest, cached=True)


def _stage(project: Project, stage: Path) -> None:
    for relpath, path in iter_project_files(project.root):
        dest = stage / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)


def _wheel_file(path: Path) -> WheelFile:
    return WheelFile(filename=path.name, sha256=sha256_file(path), size=path.stat().st_size)


def _build(
    project: Project,
    refs: dict[str, str | None],
    target: Target,
    runtime: RuntimeSource,
    cache: Path,
) -> Bundle:
    work = work_dir(cache, "bundle-")
    try:
        stage = work / "stage"
        _stage(project, stage)
        # Key the bundle by what was actually built, even if the project changed
        # between hashing and staging.
        tree = tree_digest(stage)
        split = grader_split(load_project(stage), refs)
        grader_only = split.grader_only
        digest = _inputs_digest(tree, refs, grader_only, target, runtime)
        built = _project_wheel(stage, tree, cache, work, what=f"the project in {project.root}")
        info = read_wheel(built)
        if project.package not in info.top_level:
            raise BundleBuildError(
                f"the wheel built from {project.pyproject} ({built.name}) does not contain the "
                f"package {project.package!r}; configure the build backend to include it "
                '(e.g. setuptools: [tool.setuptools.packages.find] where = ["src"]; '
                "hatchling: [tool.hatch.build.targets.wheel] packages = [...])."
            )
        _check_grader_only(built, grader_only, project)
        requirements = [
            r
            for r in target_requirements(info.requires, target.env)
            if canonicalize_name(Requirement(r).name) not in _PROVIDED
        ]
        deps = _ensure_dependencies(cache, requirements, runtime, target)

        bundle_dir = work / "bundle"
        (bundle_dir / "wheel").mkdir(parents=True)
        (bundle_dir / "wheelhouse").mkdir()
        wheel_path = bundle_dir / "wheel" / built.name
        copy_or_link(built, wheel_path)
        for entry in deps.wheels:
            name = entry.filename
            copy_or_link(deps.directory / name, bundle_dir / "wheelhouse" / name)

        manifest = Manifest(
            format_version=MANIFEST_FORMAT_VERSION,
            package=project.package,
            distribution=str(info.name),
            version=str(info.version),
            workflow=refs["workflow"],
            grader=refs["grader"],
            workflow_config=refs["workflow_config"],
            grader_config=refs["grader_config"],
            wheel=_wheel_file(wheel_path),
            requirements=requirements,
            wheelhouse=deps.wheels,
            runtime_wheel=deps.runtime_wheel,
            pip_wheel=deps.pip_wheel,
            requirements_digest=deps.digest,
            python_version=target.python_version,
            platform=target.platform,
            platform_tags=target.tags,
            inputs_digest=digest,
            harbor_exec_version=runtime.version,
            grader_only=grader_only,
            grader_exposed=bool(split.exposed),
        )
        manifest.write(bundle_dir / MANIFEST_NAME)
        root = cache / "bundles" / digest[:32]
        if publish(bundle_dir, root):
            return bundle_from(root, manifest, cached=False)
        # A concurrent builder published the same inputs first: use theirs.
        return bundle_from(root, Manifest.read(root / MANIFEST_NAME), cached=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_grader_only(wheel: Path, grader_only: list[str], project: Project) -> None:
    """Each grader-only path is in the wheel where the agent's part expects to drop it."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if not n.endswith("/")]
    for path in grader_only:
        if not any(n == path or (path.endswith("/") and n.startswith(path)) for n in names):
            raise BundleBuildError(
                f"the wheel built from {project.pyproject} ({wheel.name}) has no {path}, the "
                "grader's module, at the top level where the agent's copy of the bundle leaves "
                "it out; configure the build backend to put the package at the wheel's root."
            )


def _project_wheel(stage: Path, tree: str, cache: Path, work: Path, *, what: str) -> Path:
    """The wheel built from the staged tree whose digest is ``tree``, built once.

    The wheel depends on the project's files alone, so every bundle of the same
    tree (other refs, another container Python) shares it.
    """
    entry = cache / "wheels" / _digest({"schema": _BUNDLE_SCHEMA, "tree": tree})[:32]
    found = sorted(entry.glob("*.whl"))
    if len(found) == 1:
        return found[0]
    if entry.exists():  # damaged: a published entry holds exactly one wheel
        shutil.rmtree(entry, ignore_errors=True)
    built = build_wheel(stage, work / "out", what=what, env_cache=cache)
    if publish(built.parent, entry):
        return entry / built.name
    return built  # a concurrent builder published the same tree first; ours is as good


@dataclass(frozen=True, slots=True)
class _Dependencies:
    directory: Path
    wheels: list[WheelFile]
    runtime_wheel: str
    pip_wheel: str
    digest: str


_DEPS_INDEX = "index.json"


def _ensure_dependencies(
    cache: Path, requirements: list[str], runtime: RuntimeSource, target: Target
) -> _Dependencies:
    """The dependency wheelhouse for this requirement set, collected once and reused."""
    key = _digest(
        {
            "schema": _BUNDLE_SCHEMA,
            "requirements": requirements,
            "runtime": runtime.digest,
            "python_version": target.python_version,
            "platform_tags": target.tags,
        }
    )
    entry = cache / "deps" / key[:32]
    index = entry / _DEPS_INDEX
    if not index.is_file():
        with entry_lock(cache, "deps", key):
            if not index.is_file():  # not made while this process waited
                _collect_dependencies(cache, entry, requirements, runtime, target)
    data = json.loads(index.read_text(encoding="utf-8"))
    return _Dependencies(
        directory=entry,
        wheels=[WheelFile.model_validate(w) for w in data["wheels"]],
        runtime_wheel=data["runtime_wheel"],
        pip_wheel=data["pip_wheel"],
        digest=data["digest"],
    )


def _collect_dependencies(
    cache: Path, entry: Path, requirements: list[str], runtime: RuntimeSource, target: Target
) -> None:
    """Download the wheelhouse of ``requirements`` (with the runtime and pip); publish it."""
    runtime_wheel = ensure_runtime_wheel(cache, runtime)
    work = work_dir(cache, "deps-")
    try:
        wheelhouse = work / "wheelhouse"
        roots = [Requirement(r) for r in requirements]
        # pip goes in too: a python3-only image can bootstrap a venv from it.
        roots.append(Requirement("pip"))
        paths = download_wheels(roots, [runtime_wheel], wheelhouse, target)
        wheels = [_wheel_file(p) for p in paths]
        infos = {read_wheel(p).name: p.name for p in paths}
        payload = {
            "wheels": [w.model_dump() for w in sorted(wheels, key=lambda w: w.filename)],
            "runtime_wheel": infos[canonicalize_name(RUNTIME_DISTRIBUTION)],
            "pip_wheel": infos[canonicalize_name("pip")],
            # Names and hashes only: the same wheels give the same digest anywhere.
            "digest": _digest(sorted((w.filename, w.sha256) for w in wheels)),
        }
        (wheelhouse / _DEPS_INDEX).write_text(json.dumps(payload, indent=2), encoding="utf-8")
        publish(wheelhouse, entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)
