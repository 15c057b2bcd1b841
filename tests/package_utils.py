"""Package sources for tests: Harbor's package cache layout, its published archives,
and a mirror of them served on 127.0.0.1."""

from __future__ import annotations

import functools
import http.server
import io
import json
import shutil
import tarfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from harbor_exec.sources.packages import content_digest, dataset_digest, read_manifest

ROOT = Path(__file__).resolve().parents[1]
HELLO = ROOT / "tasks_examples" / "dataset" / "hello-shell"
FIB = ROOT / "tasks_examples" / "dataset" / "python-fib"


def add_task(
    source: Path,
    task_dir: Path,
    name: str,
    *,
    tags: Mapping[str, str] | None = None,
    revisions: Mapping[int, str] | None = None,
) -> str:
    """``task_dir`` copied into ``source`` as ``<org>/<name>/<hex>/`` (Harbor's package
    cache); returns its digest. ``tags``/``revisions`` (``"self"``: this digest) go into
    the package's ``index.json``."""
    digest = content_digest(task_dir)
    org, short = name.split("/")
    shutil.copytree(task_dir, source / org / short / digest.removeprefix("sha256:"))
    write_index(source, name, tags=tags, revisions=revisions, digest=digest)
    return digest


def write_index(
    source: Path,
    name: str,
    *,
    tags: Mapping[str, str] | None = None,
    revisions: Mapping[int, str] | None = None,
    digest: str = "",
) -> None:
    if not tags and not revisions:
        return
    path = source / name / "index.json"
    index = json.loads(path.read_text()) if path.exists() else {"tags": {}, "revisions": {}}
    for key, value in (tags or {}).items():
        index["tags"][key] = digest if value == "self" else value
    for number, value in (revisions or {}).items():
        index["revisions"][str(number)] = digest if value == "self" else value
    path.write_text(json.dumps(index))


def add_dataset(source: Path, name: str, tasks: Mapping[str, str], **index: object) -> str:
    """A dataset package whose ``dataset.toml`` pins ``tasks`` (name -> digest)."""
    lines = [f'[dataset]\nname = "{name}"\nversion = "1.0"\n']
    for task, digest in tasks.items():
        lines.append(f'[[tasks]]\nname = "{task}"\ndigest = "{digest}"\n')
    staging = source / ".staging-dataset"
    staging.mkdir()
    (staging / "dataset.toml").write_text("\n".join(lines))
    digest = dataset_digest(read_manifest(staging / "dataset.toml"))
    org, short = name.split("/")
    target = source / org / short / digest.removeprefix("sha256:")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(target)
    write_index(source, name, digest=digest, **index)  # type: ignore[arg-type]
    return digest


def harbor_archive(package_dir: Path, *, extra: list[tarfile.TarInfo] | None = None) -> bytes:
    """``dist.tar.gz`` as Harbor's publisher writes it: regular files only, relative."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(p for p in package_dir.rglob("*") if p.is_file()):
            info = tarfile.TarInfo(path.relative_to(package_dir).as_posix())
            info.size = path.stat().st_size
            info.mode = 0o755 if path.stat().st_mode & 0o111 else 0o644
            with path.open("rb") as handle:
                tar.addfile(info, handle)
        for info in extra or []:
            data = b"evil\n" if info.isfile() else b""
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def mirror_of(source: Path, mirror: Path) -> None:
    """The mirror layout of a directory source: index files, one archive a digest."""
    for package in source.glob("*/*"):
        if not package.is_dir() or package.name.startswith("."):
            continue
        target = mirror / package.relative_to(source)
        target.mkdir(parents=True, exist_ok=True)
        if (package / "index.json").exists():
            shutil.copy(package / "index.json", target / "index.json")
        for entry in package.iterdir():
            if entry.is_dir():
                (target / entry.name).mkdir(exist_ok=True)
                (target / entry.name / "dist.tar.gz").write_bytes(harbor_archive(entry))


@contextmanager
def serve_dir(root: Path) -> Iterator[tuple[str, list[str]]]:
    """``root`` served over HTTP on 127.0.0.1; yields (base URL, paths requested)."""
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            requested.append(self.path)

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requested
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
