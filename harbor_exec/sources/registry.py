"""Harbor's JSON registry: datasets named ``name@version`` whose tasks are git refs.

The registry is a JSON list of ``{name, version, description, tasks: [{name, git_url,
git_commit_id, path}], metrics}`` (Harbor 0.26 ``models/registry.py``), read from a
file (``--registry-path``) or a URL (``--registry-url``) the operator names. A
dataset's tasks are fetched through ``GitTaskSource`` (shallow, by commit, into the
content-addressed cache, nothing of the repository run): the operator's naming the
registry is what allows its URLs, and a task without a full commit id runs only when
the operator also allows unpinned refs. ``name`` without ``@version`` picks Harbor's
choice: ``head`` if listed, else the highest PEP 440 version, else the lexically last.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import requests
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from harbor_exec.errors import HarborExecError
from harbor_exec.sources.git import GitTaskError, GitTaskSource

#: A registry bigger than this is refused before it is parsed (Harbor's is ~2 MB).
MAX_REGISTRY_BYTES = 64 * 1024 * 1024
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


class RegistryError(HarborExecError):
    """The registry cannot be read, or names no such dataset, or a task fails to fetch."""


class RegistryTask(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    git_url: str | None = None
    git_commit_id: str | None = None
    path: str = "."


class RegistryDataset(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    version: str
    description: str = ""
    tasks: list[RegistryTask] = Field(default_factory=list)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class FetchedTask:
    """One registry task on this machine: its directory and the commit it is at."""

    task: RegistryTask
    directory: Path
    commit: str


def read_registry(
    *, path: Path | None = None, url: str | None = None, timeout_sec: float = 60.0
) -> list[RegistryDataset]:
    """The datasets of the registry at ``path`` or ``url`` (exactly one)."""
    if (path is None) == (url is None):
        raise RegistryError("name the registry with exactly one of a path and a URL")
    where = str(path) if path is not None else str(url)
    if path is not None:
        try:
            if path.stat().st_size > MAX_REGISTRY_BYTES:
                raise RegistryError(f"{where}: larger than {MAX_REGISTRY_BYTES} bytes")
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise RegistryError(f"{where}: {exc.strerror or exc}") from None
    else:
        assert url is not None
        text = _download(url, timeout_sec)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RegistryError(f"{where}: not JSON ({exc})") from None
    if not isinstance(rows, list):
        raise RegistryError(f"{where}: a registry is a JSON list of datasets")
    datasets: list[RegistryDataset] = []
    for index, row in enumerate(rows):
        try:
            datasets.append(RegistryDataset.model_validate(row))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            raise RegistryError(f"{where}: dataset [{index}].{field}: {first['msg']}") from None
    return datasets


def _download(url: str, timeout_sec: float) -> str:
    try:
        with requests.get(url, timeout=timeout_sec, stream=True) as response:
            response.raise_for_status()
            body = bytearray()
            for chunk in response.iter_content(1 << 16):
                body += chunk
                if len(body) > MAX_REGISTRY_BYTES:
                    raise RegistryError(f"{url}: larger than {MAX_REGISTRY_BYTES} bytes")
            return body.decode("utf-8")
    except (requests.RequestException, UnicodeDecodeError) as exc:
        raise RegistryError(f"{url}: {exc}") from None


def find_dataset(datasets: Sequence[RegistryDataset], ref: str) -> RegistryDataset:
    """The dataset ``name@version`` (or ``name``, at Harbor's chosen version)."""
    name, _, version = ref.partition("@")
    versions = {d.version: d for d in datasets if d.name == name}
    if not versions:
        known = ", ".join(sorted({d.name for d in datasets})) or "none"
        raise RegistryError(f"no dataset {name!r} in the registry (it has: {known})")
    chosen = version or resolve_version(list(versions))
    if chosen not in versions:
        raise RegistryError(
            f"dataset {name!r} has no version {chosen!r} (it has: {', '.join(sorted(versions))})"
        )
    return versions[chosen]


def resolve_version(versions: list[str]) -> str:
    """Harbor's choice: ``head``, else the highest numeric version (``1.10`` over
    ``1.9``), else the lexically last."""
    if "head" in versions:
        return "head"
    numeric = [v for v in versions if re.fullmatch(r"v?\d+(\.\d+)*", v)]
    if numeric:
        return max(numeric, key=lambda v: tuple(int(p) for p in v.lstrip("v").split(".")))
    return sorted(versions)[-1]


def fetch_dataset(
    dataset: RegistryDataset, *, allow_unpinned: bool = False, cache_dir: Path | None = None
) -> list[FetchedTask]:
    """Every task of ``dataset``, fetched by commit (cached: a second call fetches
    nothing). A task without a git URL, or unpinned without ``allow_unpinned``, is
    an error naming it, before anything runs."""
    for task in dataset.tasks:
        if task.git_url is None:
            raise RegistryError(f"{dataset.ref}: task {task.name!r} has no git_url")
        commit = task.git_commit_id
        if not allow_unpinned and (commit is None or not _COMMIT.fullmatch(commit)):
            raise RegistryError(
                f"{dataset.ref}: task {task.name!r} is not pinned to a full commit id "
                f"(git_commit_id {commit!r}); allow unpinned refs to run it at the remote's HEAD"
            )
    source = GitTaskSource(
        allow=tuple(sorted({t.git_url for t in dataset.tasks if t.git_url})),
        allow_unpinned=allow_unpinned,
    )
    if cache_dir is not None:
        source.cache_dir = cache_dir
    fetched: list[FetchedTask] = []
    for task in dataset.tasks:
        assert task.git_url is not None
        commit = (
            task.git_commit_id
            if task.git_commit_id and _COMMIT.fullmatch(task.git_commit_id)
            else None
        )
        try:
            directory, pinned = source.checkout(task.git_url, commit, task.path)
        except GitTaskError as exc:
            raise RegistryError(f"{dataset.ref}: task {task.name!r}: {exc}") from None
        fetched.append(FetchedTask(task, directory, pinned))
    return fetched
