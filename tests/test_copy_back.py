"""Copying back what a hostile container wrote, without Docker: the extractor's
budgets (bytes read, files, directories, every entry, depth, names and paths), the
skip-and-record of what the host cannot write, and the trial's order over
``FakeRuntime``: the verdict first, on its own budget, then the agent's outputs."""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from harbor_exec.errors import policy_for
from harbor_exec.sandbox.archives import (
    ArchiveEntry,
    OutputLimits,
    extract_archive,
    write_archive,
)
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from tests.fake_runtime import FakeContainer, FakeRuntime
from tests.task_factory import make_task


def tar_of(*members: tuple[str, bytes | str | None]) -> bytes:
    """A tar of ``(name, data)``: bytes a file, None a directory, a str a symlink target."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_directories_spend_their_own_budget(tmp_path: Path) -> None:
    data = tar_of(("logs", None), *((f"logs/d{i}", None) for i in range(50)))
    report = extract_archive(data, tmp_path / "out", limits=OutputLimits(max_dirs=10))
    assert report.exceeded == "dirs" and report.incomplete
    assert len(list((tmp_path / "out").iterdir())) == 10


def test_implied_parent_directories_are_counted_too(tmp_path: Path) -> None:
    data = tar_of(*((f"logs/a{i}/b/c/f", b"x") for i in range(10)))
    report = extract_archive(data, tmp_path / "out", limits=OutputLimits(max_dirs=7))
    assert report.exceeded == "dirs"
    assert report.dirs <= 7 and report.files == 2


def test_every_entry_counts_links_included(tmp_path: Path) -> None:
    data = tar_of(*((f"logs/l{i}", "/etc/passwd") for i in range(30)), ("logs/late", b"x"))
    report = extract_archive(data, tmp_path / "out", limits=OutputLimits(max_entries=20))
    assert report.exceeded == "entries"
    assert report.skipped_count == 20
    assert not (tmp_path / "out" / "late").exists()


def test_deep_long_and_unwritable_entries_are_skipped_and_recorded(tmp_path: Path) -> None:
    deep = "/".join(["d"] * 40)
    long_path = "/".join(["p" * 200] * 20)  # 4,019 bytes: legal in a container, not here
    data = tar_of(
        (f"logs/{deep}/f", b"deep"),
        (f"logs/{long_path}/f", b"long"),
        (f"logs/{'n' * 300}", b"long name"),
        ("logs/clash", b"a file"),
        ("logs/clash/inside", b"under a file"),  # the host refuses this one
        ("logs/ok.txt", b"fine"),
    )
    report = extract_archive(data, tmp_path / "out")
    assert not report.incomplete
    assert (tmp_path / "out" / "ok.txt").read_bytes() == b"fine"
    reasons = " ".join(report.skipped)
    assert "deeper than 32" in reasons and "path longer than 1024" in reasons
    assert "name longer than 255" in reasons and "cannot be written" in reasons
    assert report.skipped_count == 4


def test_skipped_names_are_bounded(tmp_path: Path) -> None:
    data = tar_of(*((f"logs/{i}-{'x' * 300}", b"") for i in range(150)))
    report = extract_archive(data, tmp_path / "out")
    assert report.skipped_count == 150 and len(report.skipped) == 100
    assert all(len(line) < 300 for line in report.skipped)


def test_bytes_read_spend_the_budget_even_when_only_the_tail_is_kept(tmp_path: Path) -> None:
    limits = OutputLimits(max_file_bytes=1000, max_total_bytes=100_000)
    data = tar_of(("logs/huge", b"z" * 300_000), ("logs/after", b"never"))
    report = extract_archive(data, tmp_path / "out", limits=limits)
    assert report.exceeded == "bytes" and report.bytes_read == 100_000
    kept = (tmp_path / "out" / "huge").read_bytes()
    assert kept.startswith(b"[harbor-exec: the copy-back budget ran out after 100000 of 300000")
    assert len(kept) < 1200
    assert not (tmp_path / "out" / "after").exists()


def test_a_spent_budget_closes_the_stream_at_once(tmp_path: Path) -> None:
    data = tar_of(*((f"logs/f{i}", b"y" * 10_000) for i in range(200)))
    chunk = 8192
    consumed = []
    closed = []

    def stream() -> Iterator[bytes]:
        try:
            for offset in range(0, len(data), chunk):
                consumed.append(offset)
                yield data[offset : offset + chunk]
        finally:
            closed.append(True)

    report = extract_archive(stream(), tmp_path / "out", limits=OutputLimits(max_files=5))
    assert report.exceeded == "files" and report.files == 5
    assert closed == [True]
    assert len(consumed) * chunk < len(data) // 10


def test_several_archives_share_one_budget(tmp_path: Path) -> None:
    limits = OutputLimits(max_files=3)
    first = extract_archive(tar_of(("a/1", b""), ("a/2", b"")), tmp_path / "a", limits=limits)
    second = tar_of(("b/1", b""), ("b/2", b""))
    extract_archive(second, tmp_path / "b", limits=limits, report=first)
    assert first.files == 3 and first.exceeded == "files"
    # A spent budget reads nothing more (and still closes what it was given).
    extract_archive(tar_of(("c/1", b"")), tmp_path / "c", limits=limits, report=first)
    assert not (tmp_path / "c").exists()


def test_write_archive_streams_trees_from_disk(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a.txt").write_text("a")
    (tree / "run.sh").write_text("#!/bin/sh\n")
    (tree / "run.sh").chmod(0o755)
    (tree / "link").symlink_to("/etc/passwd")
    single = tmp_path / "one.txt"
    single.write_text("one")
    with (tmp_path / "out.tar").open("w+b") as target:
        write_archive(
            target,
            [ArchiveEntry("/logs", None, 0o777), ArchiveEntry("/logs/x", b"x")],
            [(tree, "/app/tree"), (single, "/app/one.txt")],
        )
        target.seek(0)
        with tarfile.open(fileobj=target) as tar:
            members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {
        "logs",
        "logs/x",
        "app/tree",
        "app/tree/run.sh",
        "app/tree/sub",
        "app/tree/sub/a.txt",
        "app/one.txt",
    }
    assert members["app/tree/run.sh"].mode == 0o755 and members["logs"].mode == 0o777


# --------------------------------------------------------------------------- trials


def flood(container: FakeContainer) -> int:
    """The agent writes more files than its budget into /logs/artifacts."""
    for i in range(50):
        container.write(f"/logs/artifacts/f{i:03}", b"x")
    container.write("/logs/agent/oracle.txt", "done\n")
    return 0


def verdict_zero(container: FakeContainer) -> int:
    container.write("/logs/verifier/reward.txt", "0")
    return 0


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_agent_flood_is_the_agents_fault_and_the_verdict_stands(tmp_path: Path, mode: str) -> None:
    task_dir = make_task(tmp_path / "tasks", f"flood-{uuid.uuid4().hex[:6]}")
    request = TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"))
    policy = SandboxPolicy(verifier_mode=mode, output=OutputLimits(max_files=10))  # type: ignore[arg-type]
    request.spec = replace(request.spec, policy=policy)
    result = run_trial(FakeRuntime(solve=flood, test=verdict_zero), request)
    assert result.verifier_environment_mode == mode
    assert result.exception_type == "AgentOutputLimitError"
    assert policy_for("AgentOutputLimitError").phase is not None
    assert result.reward_valid and result.reward == 0.0
    out = tmp_path / "trials" / result.trial_name
    notes = json.loads((out / "copy-back.json").read_text())
    assert notes["agent"]["exceeded"] == "files" and "verifier" not in notes
    # What the agent flooded is cut; Harbor's manifest of the collection stays beside it.
    manifest = out / "artifacts" / "manifest.json"
    assert json.loads(manifest.read_text())[0]["source"] == "/logs/artifacts"
    assert tree_size(out / "artifacts") - manifest.stat().st_size < 100


def test_a_verifier_error_wins_over_the_agents_flood(tmp_path: Path) -> None:
    task_dir = make_task(tmp_path / "tasks", "flood-silent")
    request = TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"))
    request.spec = replace(
        request.spec,
        policy=SandboxPolicy(verifier_mode="separate", output=OutputLimits(max_files=10)),
    )
    result = run_trial(FakeRuntime(solve=flood, test=lambda container: 0), request)
    assert result.exception_type == "RewardFileNotFoundError"


def test_a_verifier_that_floods_its_own_dir_still_has_its_reward_read(tmp_path: Path) -> None:
    def noisy_test(container: FakeContainer) -> int:
        for i in range(50):
            container.write(f"/logs/verifier/a{i:03}.log", b"noise")
        container.write("/logs/verifier/reward.txt", "0")
        return 0

    task_dir = make_task(tmp_path / "tasks", "noisy-verifier")
    request = TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"))
    request.spec = replace(
        request.spec, policy=SandboxPolicy(verifier_output=OutputLimits(max_files=10))
    )
    result = run_trial(FakeRuntime(test=noisy_test), request)
    assert result.exception_info is None, result.exception_info
    assert result.reward_valid and result.reward == 0.0
    notes = json.loads((tmp_path / "trials" / result.trial_name / "copy-back.json").read_text())
    assert notes["verifier"]["exceeded"] == "files"


def test_a_garbled_archive_keeps_what_was_written(tmp_path: Path) -> None:
    data = tar_of(("logs/first", b"kept"), ("logs/second", b"z" * 5000))
    report = extract_archive(data[:2048], tmp_path / "out")  # cut inside the second file
    assert (tmp_path / "out" / "first").read_bytes() == b"kept"
    assert any("unreadable tar" in line for line in report.skipped)


def test_routes_split_one_archive_and_stop_before_what_follows(tmp_path: Path) -> None:
    chunk = 4096
    data = tar_of(
        ("logs", None),
        ("logs/aaa", b"q" * 10_000),  # not routed: passed over, its bytes charged
        ("logs/agent", None),
        ("logs/agent/oracle.txt", b"solved"),
        ("logs/artifacts", None),
        ("logs/artifacts/a.txt", b"art"),
        *((f"logs/verifier/f{i}", b"v" * 10_000) for i in range(50)),
    )
    consumed: list[int] = []

    def stream() -> Iterator[bytes]:
        for offset in range(0, len(data), chunk):
            consumed.append(offset)
            yield data[offset : offset + chunk]

    routes = {"agent": tmp_path / "agent", "artifacts": tmp_path / "art"}
    report = extract_archive(stream(), tmp_path, routes=routes)
    assert (tmp_path / "agent" / "oracle.txt").read_bytes() == b"solved"
    assert (tmp_path / "art" / "a.txt").read_bytes() == b"art"
    assert not (tmp_path / "aaa").exists() and not (tmp_path / "verifier").exists()
    assert report.bytes_read == 10_000 + 6 + 3 and not report.incomplete
    assert len(consumed) * chunk < 60_000  # the verifier's 500 kB were never streamed
