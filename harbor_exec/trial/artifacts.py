"""A trial's artifacts, as Harbor 0.26 keeps them under ``<trial>/artifacts/``.

``/logs/artifacts`` (the agent's conventional publish dir, Harbor's implicit first
entry) is read back with the agent's logs; the task's declared ``artifacts`` are
copied out of the agent's container once, after the agent and before any verifier,
on the agent's copy-back budget; ``manifest.json`` lists them all. A multi-step trial
collects each step's anew (``begin_step``) and archives them under ``steps/<name>/``.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from harbor_exec.sandbox.archives import ExtractReport, OutputLimits, extract_archive
from harbor_exec.sandbox.runtime import ContainerRuntime
from harbor_exec.tasks.task import Task

#: The agent's conventional publish dir (Harbor's implicit first artifact).
CONVENTION_DIR = "/logs/artifacts"


class TrialArtifacts:
    """One trial's artifacts: where they land on the host, what was collected, and
    ``manifest.json``."""

    def __init__(
        self,
        runtime: ContainerRuntime,
        trial_dir: Path,
        *,
        limits: OutputLimits,
        budget: ExtractReport,
    ) -> None:
        self.runtime = runtime
        self.trial_dir = trial_dir
        self.root = trial_dir / "artifacts"
        self.limits = limits
        #: Shared with the agent's logs: one budget for everything the agent wrote.
        self.budget = budget
        #: Declared artifacts' manifest rows, once collected (``collect``).
        self.entries: list[dict[str, object]] | None = None
        self.carried: list[tuple[Path, str]] = []
        #: A multi-step trial moved this step's artifacts into ``steps/<name>/``.
        self.archived = False

    @property
    def convention_dir(self) -> Path:
        """Where ``/logs/artifacts`` is read back to (Harbor's ``artifacts/logs/artifacts``)."""
        return self.root / CONVENTION_DIR.lstrip("/")

    def convention_artifacts(self) -> list[tuple[Path, str]]:
        """``/logs/artifacts``'s children as read back, for a verifier container; the
        directory itself stays the verifier's, mode 777."""
        convention = self.convention_dir
        if not convention.is_dir():
            return []
        return [(path, f"{CONVENTION_DIR}/{path.name}") for path in convention.iterdir()]

    def drop_convention_excludes(self, task: Task) -> None:
        """An explicit ``/logs/artifacts`` entry's excludes, once, as it lands."""
        drop_excluded(self.convention_dir, artifact_specs(task)[1])

    def collect(self, container_id: str, task: Task) -> list[tuple[Path, str]]:
        """Copy ``task``'s declared ``artifacts`` out of the agent's container (on the
        agent's budget, sanitized) into ``artifacts/``, where Harbor keeps them;
        returns ``(host path, container path)`` of them for a verifier container.
        Once per trial (per step): after the agent, before any verifier (as Harbor does)."""
        if self.entries is not None:
            return self.carried
        limits, budget, root = self.limits, self.budget, self.root
        declared, _ = artifact_specs(task)
        entries: list[dict[str, object]] = []
        carried: list[tuple[Path, str]] = []
        claimed = [self.convention_dir]
        for spec in declared:
            source = str(spec.get("source") or "")
            exclude = [str(e) for e in spec.get("exclude") or []]
            target = artifact_host_path(root, source, spec.get("destination"))
            overlaps = any(
                c == target or c in target.parents or target in c.parents for c in claimed
            )
            if (
                not source.startswith("/")
                or overlaps
                or not target.resolve().is_relative_to(root.resolve())
            ):
                # Harbor keeps the first claimant of a host path; so do we.
                entries.append(manifest_entry(source, root, target, "skipped", exclude=exclude))
                continue
            claimed.append(target)
            stream = self.runtime.get_archive(container_id, source)
            if stream is None:
                entries.append(manifest_entry(source, root, target, "failed", exclude=exclude))
                continue
            cut_before = len(budget.truncated)
            with tempfile.TemporaryDirectory(dir=self.trial_dir) as scratch:
                extract_archive(stream, Path(scratch), strip=0, limits=limits, report=budget)
                fetched = Path(scratch) / PurePosixPath(source).name
                drop_excluded(fetched, exclude)
                if target.exists():
                    remove_path(target)
                target.parent.mkdir(parents=True, exist_ok=True)
                if fetched.exists():
                    shutil.move(str(fetched), target)
            if target.is_file() or target.is_dir():
                carried.append((target, source))
            status = "ok" if target.exists() else "failed"
            entry = manifest_entry(source, root, target, status, exclude=exclude)
            if budget.truncated[cut_before:] or budget.incomplete:
                # Ours, beside Harbor's fields (its reader ignores extra keys).
                entry["truncated"] = budget.truncated[cut_before:]
                entry["budget_exceeded"] = budget.exceeded
            entries.append(entry)
        self.entries, self.carried = entries, carried
        return carried

    def write_manifest(self, task: Task) -> None:
        """Harbor's ``artifacts/manifest.json``: ``/logs/artifacts`` first, then each
        declared artifact, once they were collected."""
        if self.entries is None or self.archived:
            return
        root, convention = self.root, self.convention_dir
        status = "ok" if convention.is_dir() and any(convention.iterdir()) else "empty"
        first = manifest_entry(
            CONVENTION_DIR, root, convention, status, is_dir=True, exclude=artifact_specs(task)[1]
        )
        root.mkdir(parents=True, exist_ok=True)
        manifest = [first, *self.entries]
        (root / "manifest.json").write_text(json.dumps(manifest, indent=2))

    def begin_step(self) -> None:
        """Fresh state for a step: its artifacts are collected anew."""
        self.archived = False
        self.entries, self.carried = None, []

    def step_archived(self) -> None:
        """The step's artifacts moved to ``steps/<name>/``: nothing is collected or
        written again at teardown."""
        self.archived = True
        if self.entries is None:
            self.entries = []


def artifact_specs(task: Task) -> tuple[list[dict[str, Any]], list[str]]:
    """The task's declared artifacts besides ``/logs/artifacts``, and the excludes of
    ``/logs/artifacts`` (Harbor's implicit first entry, which an explicit entry for it
    replaces)."""
    specs = [{"source": i} if isinstance(i, str) else dict(i) for i in task.artifacts]
    declared = [s for s in specs if str(s.get("source") or "").rstrip("/") != CONVENTION_DIR]
    explicit = [s for s in specs if s not in declared]
    exclude = [str(e) for e in (explicit[0].get("exclude") or [])] if explicit else []
    return declared, exclude


def remove_path(path: Path) -> None:
    """Remove a file, a symlink or a whole directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def artifact_host_path(root: Path, source: str, destination: object = None) -> Path:
    """Where Harbor 0.26 keeps an artifact under ``artifacts/``: at its relative
    ``destination``, else at its container path (``/app/x`` -> ``artifacts/app/x``);
    ``..`` parts dropped, as Harbor drops them."""
    path = PurePosixPath(str(destination) if destination else source)
    parts = [part for part in path.parts if part not in ("", "/", "..")]
    return root.joinpath(*parts)


def manifest_entry(
    source: str,
    root: Path,
    target: Path,
    status: str,
    *,
    is_dir: bool | None = None,
    exclude: Sequence[str] = (),
) -> dict[str, object]:
    """One row of Harbor's ``artifacts/manifest.json`` (``ArtifactManifestEntry``)."""
    if is_dir is None:
        is_dir = target.is_dir() if target.exists() else not PurePosixPath(source).suffix
    relative = target.relative_to(root).as_posix() if target.is_relative_to(root) else ""
    return {
        "source": source,
        "destination": f"artifacts/{relative}" if relative not in ("", ".") else "artifacts",
        "type": "directory" if is_dir else "file",
        "status": status,
        "service": None,
        "exclude": list(exclude) if is_dir else [],
    }


def drop_excluded(root: Path, patterns: Sequence[str]) -> None:
    """Remove what an artifact's ``exclude`` globs match (relative paths or names)."""
    if not patterns or not root.is_dir():
        return
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        rel = path.relative_to(root).as_posix()
        if any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(path.name, p) for p in patterns):
            remove_path(path)
