"""Bundles a workflow project for task containers.

``build_bundle(code_dir, workflow="pkg.mod:Workflow", ...)`` builds the project's
wheel with the standard ``build`` frontend, collects its dependency wheels (and
harbor-exec's small container runtime) for the container's Python and platform
into a wheelhouse, writes ``manifest.json``, and caches the result by a hash of
its inputs. See docs/bundles.md.
"""

from harbor_exec.bundler.bundle import Bundle, build_bundle
from harbor_exec.bundler.errors import (
    BundleBuildError,
    BundleError,
    DependencyDownloadError,
    EntryPointError,
    GraderSplitError,
    ProjectLayoutError,
)
from harbor_exec.bundler.manifest import MANIFEST_NAME, Manifest, WheelFile
from harbor_exec.bundler.wheels import DEFAULT_PLATFORM, platform_tags

__all__ = [
    "DEFAULT_PLATFORM",
    "MANIFEST_NAME",
    "Bundle",
    "BundleBuildError",
    "BundleError",
    "DependencyDownloadError",
    "EntryPointError",
    "GraderSplitError",
    "Manifest",
    "ProjectLayoutError",
    "WheelFile",
    "build_bundle",
    "platform_tags",
]
