"""bundler: real builds of the example project and of broken projects."""

# Fixtures imported from bundle_utils are parameters of the same name here.
# ruff: noqa: F811

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from harbor_exec.bundler import (
    Bundle,
    BundleBuildError,
    BundleError,
    DependencyDownloadError,
    EntryPointError,
    Manifest,
    ProjectLayoutError,
    build_bundle,
    platform_tags,
)
from harbor_exec.bundler import bundle as bundle_module
from harbor_exec.bundler.wheels import build_wheel, marker_environment, target_requirements
from tests.bundle_utils import (  # noqa: F401  (fixtures are used by name)
    EXAMPLE_DIR,
    EXAMPLE_REFS,
    GRADER_MODULE,
    WORKFLOW_MODULE,
    bundle_cache,
    example_bundle,
    flit_pyproject,
    setuptools_pyproject,
    write_project,
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# The example project's requirements: a tiny project with them reuses its dependency layer.
EXAMPLE_REQUIREMENTS = ("httpx>=0.27",)


def _tiny_project(
    root: Path, name: str = "tiny_flow", deps: tuple[str, ...] | list[str] = EXAMPLE_REQUIREMENTS
) -> Path:
    return write_project(
        root,
        {
            "pyproject.toml": flit_pyproject(name.replace("_", "-"), list(deps)),
            f"{name}/__init__.py": "",
            f"{name}/flow.py": WORKFLOW_MODULE,
            f"{name}/judge.py": GRADER_MODULE,
        },
    )


# --------------------------------------------------------------------------- the example


@pytest.mark.long(5)
def test_example_bundle_layout_and_manifest(example_bundle: Bundle) -> None:
    bundle = example_bundle
    manifest = Manifest.read(bundle.manifest_path)
    assert manifest == bundle.manifest
    assert manifest.package == "arith_agent"
    assert manifest.distribution == "arith-agent"
    assert manifest.workflow == EXAMPLE_REFS["workflow"]
    assert manifest.grader == EXAMPLE_REFS["grader"]
    assert manifest.workflow_config == EXAMPLE_REFS["workflow_config"]
    assert manifest.grader_config == EXAMPLE_REFS["grader_config"]
    assert manifest.requirements == list(EXAMPLE_REQUIREMENTS)
    assert manifest.python_version == "3.13"  # the read-only runtime's
    assert "manylinux_2_41_x86_64" in manifest.platform_tags
    assert "manylinux2014_x86_64" in manifest.platform_tags
    assert bundle.digest == manifest.inputs_digest
    assert bundle.root.name == bundle.digest[:32]

    # The user wheel: built by the project's backend, holds its package, hash matches.
    assert bundle.wheel.is_file()
    assert manifest.wheel.sha256 == _sha256(bundle.wheel)
    with zipfile.ZipFile(bundle.wheel) as wheel:
        names = wheel.namelist()
    assert "arith_agent/workflow.py" in names
    assert not any(n.startswith("harbor_exec/") for n in names)

    # The wheelhouse: exactly the manifest's files, for CPython 3.13 on manylinux.
    on_disk = sorted(p.name for p in bundle.wheelhouse.iterdir())
    assert on_disk == [w.filename for w in manifest.wheelhouse]
    for entry in manifest.wheelhouse:
        assert _sha256(bundle.wheelhouse / entry.filename) == entry.sha256
    projects = {name.split("-")[0].lower() for name in on_disk}
    assert {"httpx", "httpcore", "h11", "anyio", "idna", "certifi", "pip"} <= projects
    assert {"pydantic", "pydantic_core", "harbor_exec_runtime"} <= projects
    assert bundle.manifest.wheel.filename not in on_disk
    core = next(n for n in on_disk if n.startswith("pydantic_core-"))
    assert "-cp313-" in core and "manylinux" in core
    assert not any("-cp312-" in n or "macosx" in n or "win_amd64" in n for n in on_disk)

    # The runtime wheel holds only the container side of harbor-exec.
    with zipfile.ZipFile(bundle.wheelhouse / manifest.runtime_wheel) as runtime:
        modules = sorted(n for n in runtime.namelist() if n.startswith("harbor_exec/"))
    assert modules == [
        "harbor_exec/__init__.py",
        "harbor_exec/authoring.py",
        "harbor_exec/compat/__init__.py",
        "harbor_exec/compat/osmosis.py",
        "harbor_exec/container/__init__.py",
        "harbor_exec/container/exchange.py",
        "harbor_exec/container/forward.py",
        "harbor_exec/container/redaction.py",
        "harbor_exec/container/runner.py",
        "harbor_exec/errors.py",
        "harbor_exec/protocol.py",
    ]
    assert manifest.pip_wheel.startswith("pip-")


def test_cached_call_reuses_the_bundle(example_bundle: Bundle, bundle_cache: Path) -> None:
    # What a cached call costs is measured by bench/bench_bundle_cache.py.
    for _ in range(7):
        again = build_bundle(EXAMPLE_DIR, cache_dir=bundle_cache, **EXAMPLE_REFS)
        assert again.cached
        assert again.root == example_bundle.root
        assert again.manifest == example_bundle.manifest


def test_source_change_changes_digest_not_requirements_digest(
    tmp_path: Path, example_bundle: Bundle, bundle_cache: Path
) -> None:
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE_DIR, project)
    first = build_bundle(project, cache_dir=bundle_cache, **EXAMPLE_REFS)
    # Same content elsewhere: same digest (the path is not an input).
    assert first.digest == example_bundle.digest
    assert first.cached

    workflow = project / "src" / "arith_agent" / "workflow.py"
    workflow.write_text(workflow.read_text() + "\nEXTRA_CONSTANT = 1\n")
    second = build_bundle(project, cache_dir=bundle_cache, **EXAMPLE_REFS)
    assert not second.cached
    assert second.digest != first.digest
    assert second.root != first.root
    assert second.manifest.wheel.sha256 != first.manifest.wheel.sha256
    assert second.requirements_digest == first.requirements_digest
    assert second.manifest.wheelhouse == first.manifest.wheelhouse
    # Both stay published and intact.
    assert first.wheel.is_file() and second.wheel.is_file()

    # Changing a ref changes the digest too (the manifest differs).
    third = build_bundle(
        project, cache_dir=bundle_cache, workflow=EXAMPLE_REFS["workflow"], grader=None
    )
    assert third.digest not in {first.digest, second.digest}
    assert third.manifest.grader is None
    # ... but not the wheel: the same tree is built once.
    assert third.manifest.wheel == second.manifest.wheel
    assert len(list((bundle_cache / "wheels").iterdir())) >= 2


@pytest.mark.long(3)
def test_dependency_change_changes_requirements_digest(
    tmp_path: Path, example_bundle: Bundle, bundle_cache: Path
) -> None:
    same_deps = example_bundle.manifest.requirements
    plain = build_bundle(
        _tiny_project(tmp_path / "a", deps=same_deps),
        workflow="tiny_flow.flow:Flow",
        cache_dir=bundle_cache,
    )
    with_dep = build_bundle(
        _tiny_project(tmp_path / "b", deps=[*same_deps, "six>=1.16"]),
        workflow="tiny_flow.flow:Flow",
        cache_dir=bundle_cache,
    )
    # Another project with the example's requirement set shares its dependency layer.
    assert plain.requirements_digest == example_bundle.requirements_digest
    assert plain.manifest.wheelhouse == example_bundle.manifest.wheelhouse
    assert with_dep.manifest.requirements == [*same_deps, "six>=1.16"]
    assert plain.requirements_digest != with_dep.requirements_digest
    assert any(p.name.startswith("six-") for p in with_dep.wheelhouse.iterdir())
    assert not any(p.name.startswith("six-") for p in plain.wheelhouse.iterdir())


@pytest.mark.long(5)
def test_markers_are_evaluated_for_the_container_python(
    tmp_path: Path, bundle_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dependency only 3.11 needs lands in the wheelhouse even from a newer host.

    ``markerdep`` (a real wheel built here, served from a find-links dir) needs
    ``idna`` on Python < 3.12 only: pip alone, running on a 3.12+ host, would skip it.
    """
    dep = write_project(
        tmp_path / "markerdep",
        {
            "pyproject.toml": flit_pyproject("markerdep", ["idna>=3; python_version < '3.12'"]),
            "markerdep/__init__.py": "",
        },
    )
    links = tmp_path / "links"
    build_wheel(dep, links, what="markerdep")
    monkeypatch.setenv("PIP_FIND_LINKS", f"{links} {os.environ.get('PIP_FIND_LINKS', '')}")
    bundle = build_bundle(
        _tiny_project(tmp_path / "p", deps=["markerdep"]),
        workflow="tiny_flow.flow:Flow",
        cache_dir=bundle_cache,
        python_version="3.11",
    )
    names = [p.name for p in bundle.wheelhouse.iterdir()]
    assert any(n.startswith("markerdep-") for n in names)
    assert any(n.startswith("idna-") for n in names), names
    # And for the runtime's 3.13 (the default), idna is not needed: it is left out.
    newer = build_bundle(tmp_path / "p", workflow="tiny_flow.flow:Flow", cache_dir=bundle_cache)
    newer_names = [p.name for p in newer.wheelhouse.iterdir()]
    assert any(n.startswith("markerdep-") for n in newer_names)
    assert not any(n.startswith("idna-") for n in newer_names), newer_names
    assert any("-cp313-" in n for n in newer_names)


def test_a_damaged_wheel_entry_is_built_again(tmp_path: Path, bundle_cache: Path) -> None:
    project = _tiny_project(tmp_path / "p", name="damaged_flow")
    first = build_bundle(project, workflow="damaged_flow.flow:Flow", cache_dir=bundle_cache)
    entries = [e for e in (bundle_cache / "wheels").iterdir() if any(e.glob("damaged_flow-*"))]
    assert len(entries) == 1
    (entries[0] / "stray-0.1-py3-none-any.whl").write_bytes(b"not a wheel")
    # Other refs: a new bundle of the same tree, whose wheel entry is now unusable.
    again = build_bundle(
        project, workflow="damaged_flow.flow:Flow", grader="damaged_flow.judge:Judge",
        cache_dir=bundle_cache,
    )  # fmt: skip
    assert not again.cached
    assert [p.name for p in entries[0].glob("*.whl")] == [first.wheel.name]
    assert again.manifest.wheel.filename == first.manifest.wheel.filename


@pytest.mark.long(3)
def test_build_environment_is_made_once_per_build_requirements(
    tmp_path: Path, bundle_cache: Path
) -> None:
    """Projects with the same ``[build-system] requires`` share one cached build
    environment; what a backend asks for beyond it is installed into its own."""

    def envs(*, added: bool) -> list[Path]:
        # Other tests (and xdist workers) share the cache: pick ours by content.
        return [
            env
            for env in (bundle_cache / "build-envs").iterdir()
            if any(env.glob("lib/python*/site-packages/flit_core"))
            and any(env.glob(".added-*")) is added
        ]

    build_bundle(_tiny_project(tmp_path / "a"), workflow="tiny_flow.flow:Flow",
                 cache_dir=bundle_cache)  # fmt: skip
    build_bundle(_tiny_project(tmp_path / "b", name="other_flow"),
                 workflow="other_flow.flow:Flow", cache_dir=bundle_cache)  # fmt: skip
    assert len(envs(added=False)) == 1

    # An in-tree backend that needs flit_core only once asked (get_requires_for_build_wheel).
    project = write_project(
        tmp_path / "c",
        {
            "pyproject.toml": flit_pyproject("asking-flow").replace(
                'requires = ["flit_core>=3.9,<4"]\n        build-backend = "flit_core.buildapi"',
                'requires = []\n        build-backend = "asking"\n        backend-path = ["."]',
            ),
            "asking.py": """
                def get_requires_for_build_wheel(config_settings=None):
                    return ["flit_core>=3.9,<4"]

                def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
                    from flit_core import buildapi
                    return buildapi.build_wheel(wheel_directory, config_settings)
                """,
            "asking_flow/__init__.py": "",
            "asking_flow/flow.py": WORKFLOW_MODULE,
        },
    )
    bundle = build_bundle(project, workflow="asking_flow.flow:Flow", cache_dir=bundle_cache)
    assert bundle.manifest.distribution == "asking-flow"
    assert len(envs(added=True)) == 1
    assert len(envs(added=False)) == 1


def test_concurrent_builders_publish_one_bundle(
    tmp_path: Path, example_bundle: Bundle, bundle_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second builder waits on the entry's lock and reuses the first one's bundle."""
    # The example's dependency layer is already collected: the race is over the bundle.
    project = _tiny_project(tmp_path / "p", name="race_flow")
    results: list[Bundle] = []
    errors: list[BaseException] = []
    wheel_builds: list[Path] = []

    def counted_build_wheel(srcdir: Path, *args: Any, **kwargs: Any) -> Path:
        wheel_builds.append(srcdir)
        return build_wheel(srcdir, *args, **kwargs)

    monkeypatch.setattr(bundle_module, "build_wheel", counted_build_wheel)

    def build() -> None:
        try:
            results.append(
                build_bundle(project, workflow="race_flow.flow:Flow", cache_dir=bundle_cache)
            )
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len({b.root for b in results}) == 1
    assert results[0].manifest == results[1].manifest
    assert sorted(b.cached for b in results) == [False, True]
    assert len(wheel_builds) == 1, wheel_builds
    assert results[0].wheel.is_file()
    # No work directory of theirs is left (other builders may share the cache).
    assert not any((w / "stage" / "race_flow").exists() for w in (bundle_cache / "tmp").iterdir())


# --------------------------------------------------------------------------- broken projects


def test_no_pyproject(tmp_path: Path) -> None:
    project = write_project(tmp_path / "p", {"flowpkg/__init__.py": ""})
    with pytest.raises(ProjectLayoutError, match=r"no pyproject\.toml in .*p") as info:
        build_bundle(project, workflow="flowpkg:Flow", cache_dir=tmp_path / "cache")
    assert "[build-system]" in str(info.value)
    assert not (tmp_path / "cache").exists()


def test_missing_code_dir(tmp_path: Path) -> None:
    with pytest.raises(ProjectLayoutError, match="does not exist"):
        build_bundle(tmp_path / "nowhere", workflow="x:Y", cache_dir=tmp_path / "cache")


def test_two_top_level_packages(tmp_path: Path) -> None:
    project = write_project(
        tmp_path / "p",
        {
            "pyproject.toml": setuptools_pyproject("two"),
            "alpha/__init__.py": "",
            "beta/__init__.py": "",
            "tests/__init__.py": "",  # not a candidate: tests/ is never the package
        },
    )
    with pytest.raises(ProjectLayoutError, match="2 top-level packages") as info:
        build_bundle(project, workflow="alpha:Flow", cache_dir=tmp_path / "cache")
    assert "alpha/" in str(info.value) and "beta/" in str(info.value)
    assert "tests/" not in str(info.value)


def test_no_package(tmp_path: Path) -> None:
    project = write_project(
        tmp_path / "p", {"pyproject.toml": setuptools_pyproject("none"), "module.py": ""}
    )
    with pytest.raises(ProjectLayoutError, match="no importable package"):
        build_bundle(project, workflow="module:Flow", cache_dir=tmp_path / "cache")


def test_invalid_pyproject(tmp_path: Path) -> None:
    project = write_project(
        tmp_path / "p", {"pyproject.toml": "[project\nname=", "flowpkg/__init__.py": ""}
    )
    with pytest.raises(ProjectLayoutError, match=r"pyproject\.toml is not valid TOML"):
        build_bundle(project, workflow="flowpkg:Flow", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("tiny_flow.flow:Missing", r"tiny_flow/flow\.py defines no top-level name 'Missing'"),
        ("tiny_flow.nope:Flow", r"module 'tiny_flow\.nope' not found"),
        ("othermod.flow:Flow", r"outside the project's package 'tiny_flow'"),
        ("tiny_flow.flow.Flow", r"expected the form 'package\.module:Name'"),
    ],
)
def test_unresolvable_refs(tmp_path: Path, ref: str, expected: str) -> None:
    project = _tiny_project(tmp_path / "p")
    with pytest.raises(EntryPointError, match=expected) as info:
        build_bundle(project, workflow="tiny_flow.flow:Flow", grader=ref, cache_dir=tmp_path / "c")
    assert info.value.field == "grader"
    assert info.value.ref == ref
    assert f"grader ref {ref!r}" in str(info.value)
    # Refs are checked before anything is built.
    assert not (tmp_path / "c").exists()


def test_ref_to_module_with_syntax_error(tmp_path: Path) -> None:
    project = _tiny_project(tmp_path / "p")
    (project / "tiny_flow" / "broken.py").write_text("def oops(:\n")
    with pytest.raises(EntryPointError, match=r"tiny_flow/broken\.py line 1 does not parse"):
        build_bundle(project, workflow="tiny_flow.broken:oops", cache_dir=tmp_path / "c")


def test_refs_resolve_through_reexports_and_src_layout(tmp_path: Path, bundle_cache: Path) -> None:
    project = write_project(
        tmp_path / "p",
        {
            "pyproject.toml": flit_pyproject("src-flow", list(EXAMPLE_REQUIREMENTS)),
            "src/src_flow/__init__.py": "from src_flow.impl import Flow as Exported\n",
            "src/src_flow/impl.py": WORKFLOW_MODULE,
        },
    )
    bundle = build_bundle(project, workflow="src_flow:Exported", cache_dir=bundle_cache)
    assert bundle.manifest.package == "src_flow"
    assert bundle.manifest.workflow == "src_flow:Exported"


def test_build_error_carries_the_output_tail(tmp_path: Path, bundle_cache: Path) -> None:
    project = write_project(
        tmp_path / "p",
        {
            "pyproject.toml": """
                [build-system]
                requires = ["setuptools>=68"]
                build-backend = "setuptools.build_meta"
                """,
            "setup.py": """
                raise RuntimeError("setup.py exploded: fix the frobnicator")
                """,
            "explodingpkg/__init__.py": WORKFLOW_MODULE,
        },
    )
    with pytest.raises(BundleBuildError) as info:
        build_bundle(project, workflow="explodingpkg:Flow", cache_dir=bundle_cache)
    message = str(info.value)
    assert f"building the wheel of the project in {project}" in message
    assert "last lines of the build output" in message
    assert "setup.py exploded: fix the frobnicator" in message
    # Nothing half-built is published; the work dir is gone. (Other workers share
    # the cache, so look for this project's package name, not for new entries.)
    left = [
        f
        for d in ("bundles", "wheels", "tmp")
        for f in (bundle_cache / d).rglob("*")
        if "explodingpkg" in str(f) or (f.is_file() and b"explodingpkg" in f.read_bytes())
    ]
    assert left == []


def test_wheel_without_the_package_is_refused(tmp_path: Path, bundle_cache: Path) -> None:
    project = write_project(
        tmp_path / "p",
        {
            "pyproject.toml": setuptools_pyproject("empty-wheel")
            + "\n[tool.setuptools]\npackages = []\n",
            "flowpkg/__init__.py": WORKFLOW_MODULE,
        },
    )
    with pytest.raises(BundleBuildError, match="does not contain the package 'flowpkg'"):
        build_bundle(project, workflow="flowpkg:Flow", cache_dir=bundle_cache)


def test_dependency_that_does_not_exist(tmp_path: Path, bundle_cache: Path) -> None:
    project = _tiny_project(tmp_path / "p", deps=["harbor-exec-test-no-such-dist-7f3a==1.0"])
    with pytest.raises(DependencyDownloadError) as info:
        build_bundle(project, workflow="tiny_flow.flow:Flow", cache_dir=bundle_cache)
    message = str(info.value)
    assert "harbor-exec-test-no-such-dist-7f3a==1.0" in message
    assert "last lines of pip's output" in message


def test_bad_python_version(tmp_path: Path) -> None:
    project = _tiny_project(tmp_path / "p")
    with pytest.raises(BundleError, match=r"3\.11 or newer"):
        build_bundle(
            project, workflow="tiny_flow.flow:Flow", python_version="3.10", cache_dir=tmp_path / "c"
        )


def test_directory_symlink_is_refused(tmp_path: Path) -> None:
    project = _tiny_project(tmp_path / "p")
    outside = tmp_path / "outside"
    outside.mkdir()
    (project / "tiny_flow" / "linked").symlink_to(outside)
    with pytest.raises(ProjectLayoutError, match="symlink to a directory"):
        build_bundle(project, workflow="tiny_flow.flow:Flow", cache_dir=tmp_path / "c")


# --------------------------------------------------------------------------- pieces


def test_platform_tags_for_bookworm() -> None:
    tags = platform_tags("manylinux_2_36_x86_64")
    assert tags[0] == "manylinux_2_36_x86_64"
    assert "manylinux_2_28_x86_64" in tags and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_37_x86_64" not in tags
    legacy = platform_tags("manylinux2014_x86_64")
    assert legacy[0] == "manylinux_2_17_x86_64"
    assert "manylinux_2_28_x86_64" not in legacy
    assert platform_tags("manylinux_2_28_aarch64")[-1] == "manylinux2014_aarch64"
    assert platform_tags("linux_x86_64") == ["linux_x86_64"]


def test_target_requirements_evaluate_markers_for_the_target() -> None:
    from packaging.requirements import Requirement

    env = marker_environment("3.11", "manylinux_2_36_x86_64")
    requires = [
        Requirement("a>=1"),
        Requirement("b; python_version < '3.12'"),
        Requirement("c; python_version >= '3.12'"),
        Requirement("d; extra == 'dev'"),
        Requirement("e; sys_platform == 'win32'"),
        Requirement("f; platform_machine == 'x86_64'"),
    ]
    assert target_requirements(requires, env) == ["a>=1", "b", "f"]


# --------------------------------------------------------------------------- CLI


def test_cli_bundle_prints_what_it_built(example_bundle: Bundle, bundle_cache: Path) -> None:
    from harbor_exec.cli.app import app

    result = CliRunner().invoke(
        app,
        [
            "bundle",
            str(EXAMPLE_DIR),
            "--workflow",
            EXAMPLE_REFS["workflow"],
            "--grader",
            EXAMPLE_REFS["grader"],
            "--workflow-config",
            EXAMPLE_REFS["workflow_config"],
            "--grader-config",
            EXAMPLE_REFS["grader_config"],
            "--cache-dir",
            str(bundle_cache),
        ],
        terminal_width=200,
    )
    assert result.exit_code == 0, result.output
    assert example_bundle.wheel.name in result.output
    assert example_bundle.digest[:16] in result.output
    assert "cache hit" in result.output
    assert "httpx" in result.output


def test_cli_bundle_error_exits_1(tmp_path: Path) -> None:
    from harbor_exec.cli.app import app

    result = CliRunner().invoke(
        app,
        ["bundle", str(tmp_path), "--workflow", "x.y:Z", "--cache-dir", str(tmp_path / "c")],
        terminal_width=200,
    )
    assert result.exit_code == 1
    assert "no pyproject.toml" in result.output
    assert "[build-system]" in result.output  # printed literally, not read as markup


def test_cli_bundle_json_output(example_bundle: Bundle, bundle_cache: Path) -> None:
    from harbor_exec.cli.app import app

    result = CliRunner().invoke(
        app,
        [
            "bundle",
            str(EXAMPLE_DIR),
            *[
                arg
                for key, ref in EXAMPLE_REFS.items()
                for arg in (f"--{key.replace('_', '-')}", ref)
            ],
            "--cache-dir",
            str(bundle_cache),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["digest"] == example_bundle.digest
    assert data["cached"] is True
    assert data["root"] == str(example_bundle.root)
