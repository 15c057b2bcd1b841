"""Harbor packages: tasks and datasets named ``org/name[@ref]``, content-addressed.

A reference is ``org/name`` (Harbor's ``ORG_NAME_PATTERN``) and a ref: ``latest`` (the
default), a tag (``[a-z0-9][a-z0-9.-]*``), an integer revision, or a digest
``sha256:<hex>`` (a prefix of at least 12 hex digits picks the one digest it starts;
Harbor 0.26 ``models/package``). Harbor fetches packages from Harbor Hub; here they
come from a *package source* the operator names (``--package-source``), either

* a directory laid out as Harbor's package cache, ``<org>/<name>/<hex>/`` holding the
  package's files (``~/.cache/harbor/tasks/packages`` is one), or
* a mirror URL serving ``<org>/<name>/<hex>/dist.tar.gz`` (Harbor's published archive:
  the package's files, regular files only).

Either may hold ``<org>/<name>/index.json``, ``{"tags": {"latest": "sha256:..."},
"revisions": {"1": "sha256:..."}}``, which resolves tags and revisions (``latest``
without a ``latest`` tag is the highest revision; a directory without an index
resolves ``latest`` only when it holds one digest). A mirror is that same tree with
archives, served statically (docs/datasets.md).

Every package is checked before it is used: its content hash (Harbor's
``Packager.compute_content_hash``, :func:`content_digest`) must equal the digest it was
asked for (the ``sha256:`` ref, the index's digest for a tag, a dataset's ``[[tasks]]
digest``), else :class:`PackageDigestMismatch` names the package and both digests. A
checked package is copied into the content-addressed cache
``<cache>/packages/<org>/<name>/<hex>/`` and reused from there (a cached package costs
no fetch). A download is bounded in bytes and time and extracted as hostile content
(no path outside the package, no links, devices or special files); a directory
source's links must stay inside the package (they are copied as the files they name).
A dataset package is a ``dataset.toml`` (Harbor's ``DatasetManifest``) whose digest is
Harbor's dataset content hash over its tasks' digests and its ``[[files]]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import tomllib
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pathspec
import requests
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from harbor_exec.bundler.cache import entry_lock
from harbor_exec.bundler.wheels import sha256_file
from harbor_exec.cache import cache_root
from harbor_exec.errors import HarborExecError
from harbor_exec.sandbox.archives import OutputLimits, extract_archive

__all__ = [
    "PACKAGES",
    "PACKAGE_SOURCE_ENV",
    "DatasetManifest",
    "FetchedPackage",
    "PackageDigestMismatch",
    "PackageError",
    "PackageRef",
    "PackageSource",
    "content_digest",
    "dataset_digest",
    "is_package_ref",
    "read_manifest",
]

PACKAGES = "packages"
PACKAGE_SOURCE_ENV = "HARBOR_EXEC_PACKAGE_SOURCE"
ARCHIVE = "dist.tar.gz"  # Harbor's ARCHIVE_FILENAME
INDEX = "index.json"
MANIFEST = "dataset.toml"
_ORG_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9._-]*/[a-zA-Z0-9][a-zA-Z0-9._-]*")
_TAG = re.compile(r"[a-z0-9][a-z0-9.\-]*")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_DIGEST_PREFIX = re.compile(r"sha256:[0-9a-f]{12,64}")
_MIN_PREFIX = 12


class PackageError(HarborExecError):
    """A package reference is malformed, unknown to the source, or cannot be fetched."""


class PackageDigestMismatch(PackageError):
    """A package's content does not hash to the digest it was asked for."""

    def __init__(self, name: str, expected: str, actual: str, where: str) -> None:
        super().__init__(
            f"package {name}: digest mismatch: expected {expected} ({where}) but its "
            f"content hashes to {actual}; refused before anything ran"
        )
        self.name, self.expected, self.actual = name, expected, actual


# ------------------------------------------------------------------ references


@dataclass(frozen=True)
class PackageRef:
    """``org/name@ref`` (Harbor's ``PackageReference``)."""

    org: str
    name: str
    ref: str = "latest"

    @classmethod
    def parse(cls, text: str) -> PackageRef:
        base, at, ref = text.rpartition("@") if "@" in text else (text, "", "")
        if not _ORG_NAME.fullmatch(base) or ".." in base:
            raise PackageError(
                f"package {text!r}: the name must be org/name (letters, digits, '.', '_', "
                "'-'; not starting with '.', no '..')"
            )
        ref = ref if at else "latest"
        if not (ref.isdigit() or _DIGEST_PREFIX.fullmatch(ref) or _TAG.fullmatch(ref)):
            raise PackageError(
                f"package {text!r}: the ref must be latest, a tag ([a-z0-9][a-z0-9.-]*), a "
                f"revision number or sha256:<hex> (at least {_MIN_PREFIX} hex digits)"
            )
        org, name = base.split("/")
        return cls(org, name, ref)

    @property
    def full_name(self) -> str:
        return f"{self.org}/{self.name}"

    @property
    def kind(self) -> Literal["tag", "revision", "digest"]:
        if self.ref.isdigit():
            return "revision"
        return "digest" if self.ref.startswith("sha256:") else "tag"

    def __str__(self) -> str:
        return f"{self.full_name}@{self.ref}"


def is_package_ref(text: object) -> bool:
    """Whether ``text`` reads as ``org/name[@ref]`` rather than a path."""
    if not isinstance(text, str) or text.startswith((".", "/", "~")):
        return False
    return bool(_ORG_NAME.fullmatch(text.partition("@")[0]))


# ------------------------------------------------------------------ digests

_DEFAULT_IGNORES = ["__pycache__/", "*.pyc", ".DS_Store", "*.swp", "*.swo", "*~"]
_HARBORIGNORE = ".harborignore"
_IGNORE_SCOPES = pathspec.GitIgnoreSpec.from_lines(
    ["/tests/", "/solution/", "/steps/*/tests/", "/steps/*/solution/"]
)


class _IgnoreRules:
    """Harbor's ``TaskFileFilter``: ``.harborignore`` rules inherited down ``tests/``
    and ``solution/`` (and each step's), every ``.harborignore`` itself excluded."""

    def __init__(self, task_dir: Path) -> None:
        self.root = task_dir
        self._specs: dict[Path, pathspec.GitIgnoreSpec | None] = {}

    def _rules(self, directory: Path) -> pathspec.GitIgnoreSpec | None:
        if not _IGNORE_SCOPES.match_file(directory.relative_to(self.root).as_posix() + "/"):
            return None
        if directory not in self._specs:
            ignore = directory / _HARBORIGNORE
            if (ignore.exists() or ignore.is_symlink()) and not ignore.is_file():
                raise PackageError(f"{ignore}: ignore rules must be a regular file")
            lines = ignore.read_text().splitlines() if ignore.exists() else []
            self._specs[directory] = pathspec.GitIgnoreSpec.from_lines(lines)
        return self._specs[directory]

    def _matches(self, path: Path) -> bool:
        relative = path.relative_to(self.root)
        if relative.name == _HARBORIGNORE:
            return True
        suffix = "/" if path.is_dir() else ""
        if not _IGNORE_SCOPES.match_file(relative.as_posix() + suffix):
            return False
        specs: list[tuple[Path, pathspec.GitIgnoreSpec]] = []
        candidate = self.root
        for part in relative.parts:
            spec = self._rules(candidate)
            if spec is not None:
                specs.append((candidate, spec))
            candidate /= part
            suffix = "/" if candidate != path or path.is_dir() else ""
            if not _IGNORE_SCOPES.match_file(candidate.relative_to(self.root).as_posix() + suffix):
                continue
            excluded = False
            for directory, rules in specs:
                check = rules.check_file(candidate.relative_to(directory).as_posix() + suffix)
                if check.include is not None:
                    excluded = check.include
            if excluded:
                return True
        return False

    def excluded(self, path: Path) -> bool:
        path = Path(os.path.abspath(path))
        if not path.is_relative_to(self.root):
            return False
        if self._matches(path):
            return True
        resolved = path.resolve()
        return resolved != path and resolved.is_relative_to(self.root) and self._matches(resolved)


def _package_files(task_dir: Path) -> list[tuple[str, Path]]:
    """Harbor's ``Packager.collect_files``: ``(relative posix path, file)``, sorted."""
    rules = _IgnoreRules(task_dir)
    files: list[Path] = [
        task_dir / single
        for single in ("task.toml", "instruction.md", "README.md", "trajectory.json")
        if (task_dir / single).exists()
    ]

    def visit(directory: Path) -> None:
        for path in sorted(directory.iterdir()):
            if rules.excluded(path):
                continue
            if path.is_file():
                files.append(path)
            if path.is_dir() and not path.is_symlink():
                visit(path)

    for name in ("environment", "tests", "solution", "steps"):
        directory = task_dir / name
        if directory.exists() and not rules.excluded(directory):
            visit(directory)
    gitignore = task_dir / ".gitignore"
    lines = gitignore.read_text().splitlines() if gitignore.exists() else _DEFAULT_IGNORES
    spec = pathspec.PathSpec.from_lines("gitignore", lines)
    kept = [(f.relative_to(task_dir).as_posix(), f) for f in files]
    return sorted((rel, f) for rel, f in kept if not spec.match_file(rel))


def content_digest(task_dir: Path) -> str:
    """``sha256:<hex>``: Harbor 0.26's task content hash (``Packager``), the digest a
    package, a ``dataset.toml`` ``[[tasks]]`` entry and Harbor's job lock name."""
    root = task_dir.resolve()
    try:
        outer = hashlib.sha256()
        for rel, path in _package_files(root):
            outer.update(f"{rel}\0{sha256_file(path)}\n".encode())
    except OSError as exc:
        raise PackageError(f"{task_dir}: cannot hash its files: {exc}") from None
    return f"sha256:{outer.hexdigest()}"


# ------------------------------------------------------------------ dataset.toml


class ManifestTask(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    digest: str

    @field_validator("name")
    @classmethod
    def _org_name(cls, value: str) -> str:
        if not _ORG_NAME.fullmatch(value) or ".." in value:
            raise ValueError(f"a task name is org/name; got {value!r}")
        return value

    @field_validator("digest")
    @classmethod
    def _digest(cls, value: str) -> str:
        if not _DIGEST.fullmatch(value):
            raise ValueError(f"a digest is sha256:<64 hex digits>; got {value!r}")
        return value


class ManifestFile(BaseModel):
    model_config = ConfigDict(extra="ignore")

    path: str
    digest: str = ""

    @field_validator("path")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if "/" in value or "\\" in value or value in ("", ".", ".."):
            raise ValueError(f"a dataset file is a plain file name; got {value!r}")
        return value

    @field_validator("digest")
    @classmethod
    def _digest(cls, value: str) -> str:
        if value and not _DIGEST.fullmatch(value):
            raise ValueError(f"a digest is sha256:<64 hex digits>; got {value!r}")
        return value


class ManifestInfo(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    version: str | None = None
    description: str = ""


class DatasetManifest(BaseModel):
    """Harbor's ``dataset.toml`` (``models/dataset/manifest.py``)."""

    model_config = ConfigDict(extra="ignore")

    dataset: ManifestInfo
    tasks: list[ManifestTask] = Field(default_factory=list)
    files: list[ManifestFile] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)


def read_manifest(path: Path) -> DatasetManifest:
    """``path`` (a ``dataset.toml``) parsed; a ``PackageError`` naming the file and field."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PackageError(f"{path}: {exc}") from None
    try:
        return DatasetManifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise PackageError(f"{path}: {where}: {first['msg']}") from None


def dataset_digest(manifest: DatasetManifest) -> str:
    """Harbor's dataset content hash: sorted task digests, then ``;`` and the sorted
    ``path:digest`` of its files when it has any."""
    base = ",".join(sorted(t.digest.removeprefix("sha256:") for t in manifest.tasks))
    if manifest.files:
        base += ";" + ",".join(
            sorted(f"{f.path}:{f.digest.removeprefix('sha256:')}" for f in manifest.files)
        )
    return f"sha256:{hashlib.sha256(base.encode()).hexdigest()}"


# ------------------------------------------------------------------ the source


@dataclass(frozen=True)
class FetchedPackage:
    """A checked package in the cache: ``directory`` hashes to ``digest``."""

    ref: PackageRef
    digest: str
    directory: Path

    @property
    def task_id(self) -> dict[str, str]:
        """Harbor's ``PackageTaskId`` of the package as it was asked for."""
        return {"org": self.ref.org, "name": self.ref.name, "ref": self.ref.ref}


@dataclass(frozen=True)
class FetchedDataset:
    """A dataset package and its tasks, each checked against its ``[[tasks]]`` digest."""

    package: FetchedPackage
    manifest: DatasetManifest
    tasks: list[FetchedPackage]


@dataclass
class PackageSource:
    """Packages from the operator's directory or mirror URL (see the module doc)."""

    location: str
    cache_dir: Path = field(default_factory=lambda: cache_root() / PACKAGES)
    max_bytes: int = 512 * 1024 * 1024
    max_files: int = 20_000
    timeout_sec: float = 300.0

    @property
    def is_url(self) -> bool:
        return self.location.startswith(("http://", "https://"))

    def __post_init__(self) -> None:
        if not self.is_url:
            root = Path(self.location).expanduser()
            if not root.is_dir():
                raise PackageError(
                    f"package source {self.location!r} is neither a directory nor an http(s) URL"
                )
            self.location = str(root.resolve())

    # ------------------------------------------------------------- resolving

    def resolve(self, ref: PackageRef) -> str:
        """The full digest ``ref`` names in this source."""
        if ref.kind == "digest" and _DIGEST.fullmatch(ref.ref):
            return ref.ref
        index = self._index(ref)
        if not index and self.is_url:
            raise PackageError(
                f"package {ref}: no {INDEX} for {ref.full_name} at {self.location} (a "
                "mirror resolves tags, revisions and digest prefixes through it); name a "
                "full sha256 digest"
            )
        if ref.kind == "digest":
            known = set(index.get("tags", {}).values()) | set(index.get("revisions", {}).values())
            known |= set(self._listed_digests(ref))
            matches = sorted(d for d in known if d.startswith(ref.ref))
            if len(matches) != 1:
                why = "no digest" if not matches else f"{len(matches)} digests"
                raise PackageError(f"package {ref}: {why} in {self.location} start with it")
            return matches[0]
        if ref.kind == "revision":
            digest = index.get("revisions", {}).get(str(int(ref.ref)))
        elif ref.ref in index.get("tags", {}):
            digest = index["tags"][ref.ref]
        elif ref.ref == "latest" and index.get("revisions"):
            digest = index["revisions"][max(index["revisions"], key=int)]
        elif ref.ref == "latest" and not index:
            listed = self._listed_digests(ref)
            if len(listed) != 1:
                raise PackageError(
                    f"package {ref}: {self.location} holds {len(listed)} digests of "
                    f"{ref.full_name} and no {INDEX} to say which is latest; name a digest"
                )
            digest = listed[0]
        else:
            digest = None
        if digest is None:
            raise PackageError(f"package {ref}: no such {ref.kind} in {self.location}")
        return digest

    def _index(self, ref: PackageRef) -> dict[str, dict[str, str]]:
        where = f"{self.location}/{ref.org}/{ref.name}/{INDEX}"
        if self.is_url:
            try:
                raw = self._download_small(where)
            except _NotFound:
                return {}
        else:
            path = Path(self.location, ref.org, ref.name, INDEX)
            if not path.is_file():
                return {}
            raw = path.read_bytes()[: 1 << 20]
        try:
            data = json.loads(raw)
            index = {
                kind: {str(k): str(v) for k, v in (data.get(kind) or {}).items()}
                for kind in ("tags", "revisions")
            }
        except (ValueError, AttributeError) as exc:
            raise PackageError(f"{where}: not an index ({exc})") from None
        for kind, entries in index.items():
            for key, digest in entries.items():
                if not _DIGEST.fullmatch(digest) or (kind == "revisions" and not key.isdigit()):
                    raise PackageError(f"{where}: {kind}.{key}: {digest!r} is not a digest")
        return index

    def _listed_digests(self, ref: PackageRef) -> list[str]:
        if self.is_url:
            return []
        package = Path(self.location, ref.org, ref.name)
        if not package.is_dir():
            return []
        return sorted(
            f"sha256:{p.name}"
            for p in package.iterdir()
            if p.is_dir() and re.fullmatch(r"[0-9a-f]{64}", p.name)
        )

    # ------------------------------------------------------------- fetching

    def fetch(
        self, ref: PackageRef, digest: str | None = None, *, where: str = ""
    ) -> FetchedPackage:
        """The package ``ref`` (at ``digest`` when given, e.g. a dataset's pin), checked
        and cached; ``PackageDigestMismatch`` when its content hashes otherwise."""
        digest = digest or self.resolve(ref)
        hexdigest = digest.removeprefix("sha256:")
        entry = self.cache_dir / ref.org / ref.name / hexdigest
        if not entry.is_dir():
            entry.parent.mkdir(parents=True, exist_ok=True)
            with entry_lock(self.cache_dir, "package", hexdigest):
                if not entry.is_dir():
                    self._fill(ref, digest, entry, where or self._why(ref, digest))
        return FetchedPackage(ref, digest, entry)

    def _why(self, ref: PackageRef, digest: str) -> str:
        if ref.kind == "digest":
            return f"the ref {ref.ref}"
        return f"{ref.kind} {ref.ref} in {self.location}"

    def _fill(self, ref: PackageRef, digest: str, entry: Path, where: str) -> None:
        stage = Path(tempfile.mkdtemp(prefix=".stage-", dir=entry.parent))
        try:
            tree = stage / "package"
            hexdigest = digest.removeprefix("sha256:")
            if self.is_url:
                self._download_archive(
                    f"{self.location}/{ref.org}/{ref.name}/{hexdigest}/{ARCHIVE}", stage, tree
                )
            else:
                source = Path(self.location, ref.org, ref.name, hexdigest)
                if (source / ARCHIVE).is_file() and not (
                    (source / "task.toml").exists() or (source / MANIFEST).exists()
                ):
                    self._extract(source / ARCHIVE, tree, str(source / ARCHIVE))
                elif source.is_dir():
                    self._copy_tree(source, tree)
                else:
                    raise PackageError(f"package {ref.full_name}@{digest}: not in {self.location}")
            actual = self.digest_of(tree)
            if actual != digest:
                raise PackageDigestMismatch(ref.full_name, digest, actual, where)
            os.rename(tree, entry)
        except OSError as exc:
            raise PackageError(f"package {ref.full_name}@{digest}: {exc}") from None
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    @staticmethod
    def digest_of(tree: Path) -> str:
        """A task's content digest, or a dataset's (its ``dataset.toml``'s)."""
        if (tree / MANIFEST).is_file() and not (tree / "task.toml").exists():
            return dataset_digest(read_manifest(tree / MANIFEST))
        return content_digest(tree)

    def _copy_tree(self, source: Path, tree: Path) -> None:
        root = source.resolve()
        total = count = 0
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath, name)
                if path.is_symlink():
                    target = path.resolve()
                    if not target.is_relative_to(root) or not target.exists():
                        raise PackageError(f"{path}: a link out of the package; refused")
                    if target.is_dir():
                        raise PackageError(f"{path}: a link to a directory; refused")
                elif not (path.is_dir() or path.is_file()):
                    raise PackageError(f"{path}: not a regular file or directory; refused")
                if path.is_file():
                    count += 1
                    total += path.stat().st_size
            if total > self.max_bytes or count > self.max_files:
                raise PackageError(
                    f"{source}: more than {self.max_bytes} bytes or {self.max_files} files"
                )
        shutil.copytree(root, tree, symlinks=False)

    def _extract(self, archive: Path, tree: Path, where: str) -> None:
        limits = OutputLimits(
            max_file_bytes=self.max_bytes,
            max_total_bytes=self.max_bytes,
            max_files=self.max_files,
            max_dirs=self.max_files,
            max_entries=2 * self.max_files,
        )
        report = extract_archive(_gunzip(archive, 2 * self.max_bytes), tree, strip=0, limits=limits)
        if report.exceeded is not None:
            raise PackageError(f"{where}: over the package limit on {report.exceeded}; refused")
        if report.skipped or report.truncated:
            what = (report.skipped or report.truncated)[0]
            raise PackageError(f"{where}: not a plain package archive ({what}); refused")

    # ------------------------------------------------------------- HTTP

    def _get(self, url: str) -> requests.Response:
        try:
            response = requests.get(url, timeout=min(60.0, self.timeout_sec), stream=True)
        except requests.RequestException as exc:
            raise PackageError(f"{url}: {exc}") from None
        if response.status_code == 404:
            response.close()
            raise _NotFound(url)
        if response.status_code != 200:
            response.close()
            raise PackageError(f"{url}: HTTP {response.status_code}")
        return response

    def _stream(self, url: str, limit: int) -> Iterator[bytes]:
        deadline = time.monotonic() + self.timeout_sec
        received = 0
        with self._get(url) as response:
            try:
                for chunk in response.iter_content(1 << 16):
                    received += len(chunk)
                    if received > limit:
                        raise PackageError(f"{url}: larger than {limit} bytes; refused")
                    if time.monotonic() > deadline:
                        raise PackageError(f"{url}: took longer than {self.timeout_sec:g}s")
                    yield chunk
            except requests.RequestException as exc:
                raise PackageError(f"{url}: {exc}") from None

    def _download_small(self, url: str) -> bytes:
        return b"".join(self._stream(url, 1 << 20))

    def _download_archive(self, url: str, stage: Path, tree: Path) -> None:
        archive = stage / ARCHIVE
        try:
            with archive.open("wb") as out:
                for chunk in self._stream(url, self.max_bytes):
                    out.write(chunk)
        except _NotFound:
            raise PackageError(f"{url}: no such package archive (HTTP 404)") from None
        self._extract(archive, tree, url)


class _NotFound(PackageError):
    pass


def _gunzip(path: Path, limit: int) -> Iterator[bytes]:
    """``path``'s gzip stream decompressed in bounded pieces, cut after ``limit`` bytes
    (the tar reader then sees a truncated archive, which is refused)."""
    inflate = zlib.decompressobj(wbits=31)
    produced = 0
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 16), b""):
            data = block
            while data:
                try:
                    out = inflate.decompress(data, 1 << 20)
                except zlib.error:
                    return
                produced += len(out)
                if produced > limit:
                    return
                if out:
                    yield out
                data = inflate.unconsumed_tail


def open_package_source(location: str | None) -> PackageSource | None:
    """The operator's source (``--package-source`` or ``$HARBOR_EXEC_PACKAGE_SOURCE``)."""
    location = location or os.environ.get(PACKAGE_SOURCE_ENV) or None
    return PackageSource(location) if location else None


def fetch_task(source: PackageSource, text: str) -> FetchedPackage:
    """The task package ``text`` (``org/name[@ref]``), checked."""
    ref = PackageRef.parse(text)
    fetched = source.fetch(ref)
    if not (fetched.directory / "task.toml").is_file():
        raise PackageError(f"package {ref} is not a task (no task.toml)")
    return fetched


def fetch_dataset_package(source: PackageSource, text: str) -> FetchedDataset:
    """The dataset package ``text`` and every task its ``dataset.toml`` pins, each
    checked against its digest before anything runs."""
    ref = PackageRef.parse(text)
    package = source.fetch(ref)
    manifest_path = package.directory / MANIFEST
    if not manifest_path.is_file():
        raise PackageError(f"package {ref} is not a dataset (no {MANIFEST})")
    manifest = read_manifest(manifest_path)
    check_manifest_files(manifest, package.directory)
    tasks: list[FetchedPackage] = []
    for index, item in enumerate(manifest.tasks):
        task_ref = PackageRef.parse(f"{item.name}@{item.digest}")
        where = f"{ref.full_name}'s {MANIFEST} [[tasks]] {index}"
        fetched = source.fetch(task_ref, item.digest, where=where)
        if not (fetched.directory / "task.toml").is_file():
            raise PackageError(f"{where}: package {item.name} is not a task (no task.toml)")
        tasks.append(fetched)
    return FetchedDataset(package, manifest, tasks)


def check_manifest_files(manifest: DatasetManifest, root: Path) -> None:
    """Each ``[[files]]`` entry with a digest present in ``root`` must hash to it."""
    for item in manifest.files:
        path = root / item.path
        if item.digest and path.is_file():
            actual = f"sha256:{sha256_file(path)}"
            if actual != item.digest:
                raise PackageDigestMismatch(
                    f"{manifest.dataset.name} file {item.path}", item.digest, actual, MANIFEST
                )


def check_local_manifest(root: Path, task_dirs: Sequence[Path], names: Sequence[str]) -> None:
    """A local dataset's ``dataset.toml`` ``[[tasks]]`` digests against the task
    directories present (``names[i]`` is ``task_dirs[i]``'s task name): an entry naming
    a task here (by its ``[task] name`` or its directory's name) must match its content.
    Harbor 0.26 ignores a local ``dataset.toml``; we refuse a mismatch all the same."""
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        return
    manifest = read_manifest(manifest_path)
    check_manifest_files(manifest, root)
    by_name: dict[str, Path] = {}
    for directory, name in zip(task_dirs, names, strict=True):
        by_name.setdefault(name, directory)
        by_name.setdefault(directory.name, directory)
    for index, item in enumerate(manifest.tasks):
        found = by_name.get(item.name) or by_name.get(item.name.split("/")[1])
        if found is None:
            continue
        actual = content_digest(found)
        if actual != item.digest:
            raise PackageDigestMismatch(
                item.name, item.digest, actual, f"{manifest_path} [[tasks]] {index}"
            )
