"""Harbor packages (``harbor_exec.sources.packages``): references parsed and digests
computed as Harbor 0.26 does, a directory source laid out as Harbor's package cache, a
mirror served on 127.0.0.1, every digest checked before anything runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harbor_exec.backends.harbor.resolver import RolloutRejected, TaskResolver
from harbor_exec.cli.app import app
from harbor_exec.jobs.dataset import harbor_job_config, harbor_trial_config
from harbor_exec.protocol import ExecutionRequest
from harbor_exec.sources.packages import (
    PackageDigestMismatch,
    PackageError,
    PackageRef,
    PackageSource,
    check_local_manifest,
    content_digest,
    dataset_digest,
    fetch_dataset_package,
    fetch_task,
    is_package_ref,
    read_manifest,
)
from harbor_exec.trial.task import load_task
from tests.package_utils import (
    FIB,
    HELLO,
    add_dataset,
    add_task,
    harbor_archive,
    mirror_of,
    serve_dir,
)

ROOT = Path(__file__).resolve().parents[1]
HARBOR_PYTHON = ROOT / ".venv-harbor" / "bin" / "python"
CLI = [sys.executable, "-m", "harbor_exec.cli"]
ROOTS_MESSAGE = "is not under a served task root"


def source_at(tmp_path: Path, location: str | Path) -> PackageSource:
    return PackageSource(str(location), cache_dir=tmp_path / "cache")


def test_references_parse_as_harbors_package_reference() -> None:
    assert PackageRef.parse("acme/hello") == PackageRef("acme", "hello", "latest")
    assert PackageRef.parse("acme/hello@3").kind == "revision"
    assert PackageRef.parse("acme/hello@v1.2-rc").kind == "tag"
    digest = "sha256:" + "a" * 64
    assert PackageRef.parse(f"acme/hello@{digest}") == PackageRef("acme", "hello", digest)
    assert PackageRef.parse("acme/hello@sha256:abcdef012345").kind == "digest"
    for bad, why in (
        ("hello", "org/name"),
        ("acme/../x", "org/name"),
        (".acme/x", "org/name"),
        ("acme/hello@Bad", "the ref must be"),
        ("acme/hello@sha256:abc", "the ref must be"),
    ):
        with pytest.raises(PackageError, match=why):
            PackageRef.parse(bad)
    assert is_package_ref("acme/hello@1") and not is_package_ref("./acme/hello")
    assert not is_package_ref("/abs/path") and not is_package_ref("tasks")


def _tricky_task(root: Path) -> Path:
    """hello-shell with what Harbor's packager leaves out or follows."""
    task = root / "tricky"
    shutil.copytree(HELLO, task)
    (task / "tests" / "sub").mkdir()
    (task / "tests" / "sub" / "keep.txt").write_text("keep\n")
    (task / "tests" / "sub" / "drop.log").write_text("dropped by .harborignore\n")
    (task / "tests" / ".harborignore").write_text("*.log\n")
    (task / "tests" / "__pycache__").mkdir()
    (task / "tests" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (task / "environment" / "notes~").write_text("editor backup\n")
    (task / "README.md").write_text("# readme\n")
    (task / "stray.txt").write_text("not a task input\n")
    (task / "solution" / "link.txt").symlink_to("../tests/sub/keep.txt")
    return task


_HARBOR_DIGESTS = """
import json, sys
from pathlib import Path
from harbor.publisher.packager import Packager
from harbor.models.dataset.manifest import DatasetManifest
out = {p: "sha256:" + Packager.compute_content_hash(Path(p))[0] for p in sys.argv[2:]}
out["dataset"] = "sha256:" + DatasetManifest.from_toml_file(sys.argv[1]).compute_content_hash()
print(json.dumps(out))
"""


def test_digests_are_harbors_packager_and_dataset_hashes(tmp_path: Path) -> None:
    if not HARBOR_PYTHON.exists():
        pytest.fail(".venv-harbor is missing: run scripts/setup.sh", pytrace=False)
    tasks = [_tricky_task(tmp_path), HELLO, FIB]
    manifest = tmp_path / "dataset.toml"
    manifest.write_text(
        '[dataset]\nname = "acme/set"\n\n'
        + "".join(
            f'[[tasks]]\nname = "acme/t{i}"\ndigest = "{content_digest(t)}"\n\n'
            for i, t in enumerate(tasks)
        )
        + '[[files]]\npath = "metric.py"\ndigest = "sha256:'
        + "b" * 64
        + '"\n'
    )
    done = subprocess.run(
        [str(HARBOR_PYTHON), "-c", _HARBOR_DIGESTS, str(manifest), *map(str, tasks)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    harbor = json.loads(done.stdout.strip().splitlines()[-1])
    for task in tasks:
        assert content_digest(task) == harbor[str(task)], task
    assert dataset_digest(read_manifest(manifest)) == harbor["dataset"]
    # What the packager leaves out does not change the digest; what it hashes does.
    tricky = tasks[0]
    before = content_digest(tricky)
    (tricky / "tests" / "sub" / "drop.log").write_text("still ignored\n")
    (tricky / "stray.txt").write_text("still not an input\n")
    assert content_digest(tricky) == before
    (tricky / "tests" / "sub" / "keep.txt").write_text("changed\n")
    assert content_digest(tricky) != before


def test_a_directory_source_resolves_tags_revisions_latest_and_digest_prefixes(
    tmp_path: Path,
) -> None:
    packages = tmp_path / "packages"
    one = add_task(packages, HELLO, "acme/hello", tags={"stable": "self"}, revisions={1: "self"})
    two = add_task(packages, FIB, "acme/hello", revisions={2: "self"})
    source = source_at(tmp_path, packages)
    assert source.resolve(PackageRef.parse("acme/hello@stable")) == one
    assert source.resolve(PackageRef.parse("acme/hello@1")) == one
    assert source.resolve(PackageRef.parse("acme/hello")) == two  # highest revision
    assert source.resolve(PackageRef.parse(f"acme/hello@{one[:19]}")) == one
    with pytest.raises(PackageError, match="no such revision"):
        source.resolve(PackageRef.parse("acme/hello@7"))
    # Without an index, latest is the one digest there is (or a clear refusal).
    add_task(packages, HELLO, "acme/solo")
    assert source.resolve(PackageRef.parse("acme/solo")) == one
    fetched = fetch_task(source, "acme/hello@stable")
    assert fetched.digest == one and content_digest(fetched.directory) == one
    assert fetched.directory == tmp_path / "cache" / "acme" / "hello" / one[7:]
    assert fetched.task_id == {"org": "acme", "name": "hello", "ref": "stable"}
    # Content-addressed: by digest, the cache answers even once the source is gone.
    shutil.rmtree(packages / "acme" / "hello")
    assert fetch_task(source, f"acme/hello@{one}").directory == fetched.directory
    with pytest.raises(PackageError, match=r"acme/missing@latest: .* holds 0 digests"):
        fetch_task(source, "acme/missing")


def test_a_tampered_package_is_refused_naming_both_digests(tmp_path: Path) -> None:
    packages = tmp_path / "packages"
    digest = add_task(packages, HELLO, "acme/hello", tags={"latest": "self"})
    (packages / "acme" / "hello" / digest[7:] / "solution" / "solve.sh").write_text("exit 0\n")
    source = source_at(tmp_path, packages)
    with pytest.raises(PackageDigestMismatch) as caught:
        fetch_task(source, "acme/hello")
    message = str(caught.value)
    assert "package acme/hello" in message and digest in message
    assert content_digest(packages / "acme" / "hello" / digest[7:]) in message
    assert "tag latest" in message
    assert not (tmp_path / "cache" / "acme" / "hello" / digest[7:]).exists()
    # A link out of the package is refused before it is hashed.
    outside = tmp_path / "secret.txt"
    outside.write_text("host file\n")
    evil = add_task(packages, FIB, "acme/evil")
    (packages / "acme" / "evil" / evil[7:] / "tests" / "leak.txt").symlink_to(outside)
    with pytest.raises(PackageError, match="a link out of the package"):
        fetch_task(source, f"acme/evil@{evil}")
    (packages / "acme" / "evil" / evil[7:] / "tests" / "leak.txt").unlink()
    (packages / "acme" / "evil" / evil[7:] / "tests" / "loop").symlink_to("..")
    with pytest.raises(PackageError, match="a link to a directory"):
        fetch_task(source, f"acme/evil@{evil}")


def test_a_dataset_package_pins_its_tasks_and_a_changed_task_is_refused(tmp_path: Path) -> None:
    packages = tmp_path / "packages"
    hello = add_task(packages, HELLO, "acme/hello")
    fib = add_task(packages, FIB, "acme/fib")
    digest = add_dataset(
        packages, "acme/set", {"acme/hello": hello, "acme/fib": fib}, tags={"v1": "self"}
    )
    source = source_at(tmp_path, packages)
    fetched = fetch_dataset_package(source, "acme/set@v1")
    assert fetched.package.digest == digest
    assert [t.task_id for t in fetched.tasks] == [
        {"org": "acme", "name": "hello", "ref": hello},
        {"org": "acme", "name": "fib", "ref": fib},
    ]
    # The dataset pins a digest whose content in the source differs: refused, named.
    (packages / "acme" / "fib" / fib[7:] / "instruction.md").write_text("other\n")
    shutil.rmtree(tmp_path / "cache" / "acme" / "fib")
    with pytest.raises(PackageDigestMismatch, match=r"package acme/fib: digest mismatch") as got:
        fetch_dataset_package(source, f"acme/set@{digest}")
    assert fib in str(got.value) and "acme/set's dataset.toml [[tasks]] 1" in str(got.value)
    with pytest.raises(PackageError, match="is not a dataset"):
        fetch_dataset_package(source, f"acme/hello@{hello}")
    with pytest.raises(PackageError, match="is not a task"):
        fetch_task(source, f"acme/set@{digest}")


def test_a_mirror_on_loopback_serves_checked_archives_once(tmp_path: Path) -> None:
    packages, mirror = tmp_path / "packages", tmp_path / "mirror"
    digest = add_task(packages, HELLO, "acme/hello", tags={"latest": "self"})
    mirror_of(packages, mirror)
    with serve_dir(mirror) as (url, requested):
        source = source_at(tmp_path, url)
        fetched = fetch_task(source, "acme/hello")
        assert fetched.digest == digest and content_digest(fetched.directory) == digest
        assert (fetched.directory / "solution" / "solve.sh").stat().st_mode & 0o111
        assert f"/acme/hello/{digest[7:]}/dist.tar.gz" in requested
        requested.clear()
        fetch_task(source, f"acme/hello@{digest}")  # cached: no request at all
        assert requested == []
        with pytest.raises(PackageError, match=r"acme/nope@latest: no index.json for acme/nope"):
            fetch_task(source, "acme/nope")


@pytest.mark.parametrize(
    ("member", "why"),
    [
        (tarfile.TarInfo("../escape.txt"), "escapes the destination"),
        (tarfile.TarInfo("tests/link"), "not a regular file"),
    ],
)
def test_a_hostile_archive_is_refused(tmp_path: Path, member: tarfile.TarInfo, why: str) -> None:
    if member.name == "tests/link":
        member.type, member.linkname = tarfile.SYMTYPE, "/etc/passwd"
    packages, mirror = tmp_path / "packages", tmp_path / "mirror"
    digest = add_task(packages, HELLO, "acme/hello")
    target = mirror / "acme" / "hello" / digest[7:]
    target.mkdir(parents=True)
    built = harbor_archive(packages / "acme" / "hello" / digest[7:], extra=[member])
    (target / "dist.tar.gz").write_bytes(built)
    with serve_dir(mirror) as (url, _), pytest.raises(PackageError, match=why):
        fetch_task(source_at(tmp_path, url), f"acme/hello@{digest}")
    assert (
        not (tmp_path / "escape.txt").exists() and not (tmp_path / "cache" / "escape.txt").exists()
    )


def test_an_oversized_download_is_refused(tmp_path: Path) -> None:
    packages, mirror = tmp_path / "packages", tmp_path / "mirror"
    digest = add_task(packages, HELLO, "acme/hello")
    mirror_of(packages, mirror)
    with serve_dir(mirror) as (url, _):
        source = PackageSource(url, cache_dir=tmp_path / "cache", max_bytes=100)
        with pytest.raises(PackageError, match="larger than 100 bytes"):
            fetch_task(source, f"acme/hello@{digest}")


def test_local_dataset_toml_digests_are_checked(tmp_path: Path) -> None:
    dataset = tmp_path / "dataset"
    shutil.copytree(HELLO, dataset / "hello-shell")
    shutil.copytree(FIB, dataset / "python-fib")
    good = content_digest(dataset / "hello-shell")
    (dataset / "dataset.toml").write_text(
        f'[dataset]\nname = "acme/local"\n\n[[tasks]]\nname = "acme/hello-shell"\n'
        f'digest = "{good}"\n\n[[tasks]]\nname = "acme/not-here"\ndigest = "sha256:{"c" * 64}"\n'
    )
    dirs = [dataset / "hello-shell", dataset / "python-fib"]
    check_local_manifest(dataset, dirs, ["hello-shell", "python-fib"])  # absent: not checked
    (dataset / "hello-shell" / "tests" / "test.sh").write_text(
        "echo 1 > /logs/verifier/reward.txt\n"
    )
    with pytest.raises(PackageDigestMismatch, match="package acme/hello-shell") as got:
        check_local_manifest(dataset, dirs, ["hello-shell", "python-fib"])
    assert good in str(got.value) and "dataset.toml [[tasks]] 0" in str(got.value)
    # validate refuses it before any engine is opened (exit 2, the reason named).
    done = cli("validate", str(dataset))
    assert done.exit_code == 2, done.output
    assert "digest mismatch" in done.output and good in done.output


@dataclass
class CliResult:
    exit_code: int
    output: str  # its words, one space apart (a long line may have wrapped)


def cli(*args: str) -> CliResult:
    """The CLI in this process, with no engine to reach and no package source set."""
    env = {"DOCKER_HOST": "unix:///nonexistent", "HARBOR_EXEC_PACKAGE_SOURCE": None}
    result = CliRunner().invoke(app, list(args), env=env, terminal_width=1000)
    return CliResult(result.exit_code, " ".join(result.output.split()))


def test_cli_package_choices_are_checked_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARBOR_EXEC_CACHE_DIR", str(tmp_path / "cache"))
    packages = tmp_path / "packages"
    digest = add_task(packages, HELLO, "acme/hello")
    (packages / "acme" / "hello" / digest[7:] / "instruction.md").write_text("tampered\n")
    alone = cli("validate", "-t", "acme/hello")
    assert alone.exit_code == 2 and "--package-source DIR|URL" in alone.output
    mismatch = cli("validate", "-t", f"acme/hello@{digest}", "--package-source", str(packages))
    assert mismatch.exit_code == 2, mismatch.output
    assert "digest mismatch" in mismatch.output and digest in mismatch.output
    with_registry = cli("validate", "-d", "acme/set", "--registry-path", str(tmp_path / "r"))
    assert with_registry.exit_code == 2
    assert "go with -d NAME[@VERSION] only" in with_registry.output
    both = cli("validate", str(tmp_path), "-t", "acme/hello")
    assert both.exit_code == 2 and "give a task or dataset PATH, or -d" in both.output
    run_help = cli("run", "--help")
    assert "--package-source" in run_help.output and "ORG/NAME[@REF]" in run_help.output


def _request(metadata: dict[str, object]) -> ExecutionRequest:
    return ExecutionRequest(id="r", prompt=[], metadata=metadata)


def test_harbor_task_packages_need_the_operators_source(tmp_path: Path) -> None:
    packages = tmp_path / "packages"
    digest = add_task(packages, HELLO, "acme/hello", tags={"latest": "self"})
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    refused = TaskResolver(tasks, task_mode="dataset")
    with pytest.raises(RolloutRejected, match=ROOTS_MESSAGE):
        refused.resolve(_request({"harbor_task": "acme/hello@latest"}))
    resolver = TaskResolver(tasks, task_mode="dataset", packages=source_at(tmp_path, packages))
    resolved = resolver.resolve(_request({"harbor_task": "acme/hello"}))
    assert resolved.task_id == f"acme/hello@{digest}"
    assert resolved.task.origin == {"org": "acme", "name": "hello", "ref": "latest"}
    assert resolved.task.path == tmp_path / "cache" / "acme" / "hello" / digest[7:]
    (packages / "acme" / "hello" / digest[7:] / "task.toml").write_text(
        (HELLO / "task.toml").read_text() + "\n# changed\n"
    )
    shutil.rmtree(tmp_path / "cache")
    with pytest.raises(RolloutRejected, match="digest mismatch"):
        resolver.resolve(_request({"harbor_task": "acme/hello"}))


def test_package_tasks_are_recorded_as_harbor_records_them(tmp_path: Path) -> None:
    packages = tmp_path / "packages"
    digest = add_task(packages, HELLO, "acme/hello")
    fetched = fetch_task(source_at(tmp_path, packages), f"acme/hello@{digest}")
    task = replace(load_task(fetched.directory), origin=fetched.task_id)
    trial = harbor_trial_config(task, tmp_path / "job" / "t1", uuid.uuid4())
    assert trial["task"] == {"name": "acme/hello", "ref": digest, "source": None}
    entry = {"name": "acme/hello", "ref": "latest", "digest": digest}
    job = harbor_job_config(
        tmp_path / "job", dataset_path=None, n_attempts=1, n_concurrent=1, tasks_config=[entry]
    )
    assert job["datasets"] == [] and job["tasks"] == [entry]
