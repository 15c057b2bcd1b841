"""Harbor's reward rules, result shape and job statistics (pure logic)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from harbor_exec.agents.base import AgentInfo
from harbor_exec.errors import (
    RewardFileEmptyError,
    RewardFileNotFoundError,
    VerifierOutputParseError,
)
from harbor_exec.jobs.dataset import job_stats, mean_metric, pass_at_k
from harbor_exec.sandbox.archives import ArchiveEntry, build_archive, extract_archive
from harbor_exec.trial.results import (
    ExceptionInfo,
    TrialResult,
    VerifierResult,
    parse_rewards,
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / name).write_text(text)
    return tmp_path


def test_reward_txt_parsing(tmp_path: Path) -> None:
    assert parse_rewards(write(tmp_path, "reward.txt", " 1\n")) == {"reward": 1.0}


@pytest.mark.parametrize(
    ("name", "text", "error"),
    [
        ("reward.txt", "", RewardFileEmptyError),
        ("reward.json", "", RewardFileEmptyError),
        ("reward.txt", "PASSED", VerifierOutputParseError),
        ("reward.txt", "nan", VerifierOutputParseError),
        ("reward.txt", "inf", VerifierOutputParseError),
        ("reward.json", '{"reward": NaN}', VerifierOutputParseError),
        ("reward.json", '{"reward": 1e999}', VerifierOutputParseError),
        ("reward.json", '{"reward": "1"}', VerifierOutputParseError),
        ("reward.json", '{"reward": [1]}', VerifierOutputParseError),
        ("reward.json", "[1]", VerifierOutputParseError),
        ("reward.json", "{not json", VerifierOutputParseError),
    ],
)
def test_bad_reward_files(tmp_path: Path, name: str, text: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        parse_rewards(write(tmp_path, name, text))


def test_missing_reward(tmp_path: Path) -> None:
    with pytest.raises(RewardFileNotFoundError, match=r"reward\.json"):
        parse_rewards(tmp_path)


def test_json_wins_and_bool_becomes_float(tmp_path: Path) -> None:
    write(tmp_path, "reward.txt", "0.25")
    write(tmp_path, "reward.json", '{"a": 1, "b": 0.5, "c": true}')
    assert parse_rewards(tmp_path) == {"a": 1, "b": 0.5, "c": 1.0}


def result(
    task: str, trial: str, rewards: dict[str, float] | None, exc: str | None = None
) -> TrialResult:
    info = None
    if exc is not None:
        info = ExceptionInfo(
            exception_type=exc,
            exception_message="m",
            exception_traceback="",
            occurred_at=datetime.now(UTC),
        )
    return TrialResult(
        task_name=task,
        trial_name=trial,
        trial_uri="file:///x",
        task_id={"path": "/x"},
        task_checksum="0",
        config={},
        agent_info=AgentInfo(name="oracle", version="1.0.0"),
        verifier_result=VerifierResult(rewards=rewards) if rewards is not None else None,
        exception_info=info,
    )


def test_reward_valid_follows_harbor_policies() -> None:
    assert result("t", "a", {"reward": 1.0}).reward_valid
    assert result("t", "a", {"reward": 1.0}, "AgentTimeoutError").reward_valid
    assert not result("t", "a", {"reward": 1.0}, "VerifierTimeoutError").reward_valid
    assert not result("t", "a", None, "RewardFileNotFoundError").reward_valid
    assert not result("t", "a", {}).reward_valid
    dumped = result("t", "a", None, "CancelledError").model_dump(mode="json")
    assert dumped["exception_info"]["policy"] == {
        "should_retry": False,
        "should_grade": False,
        "has_valid_reward": False,
    }


def test_mean_over_valid_trials_only_and_exception_stats() -> None:
    results = [
        result("t1", "t1__a", {"reward": 1.0}),
        result("t2", "t2__a", {"reward": 0.0}),
        result("t3", "t3__a", None, "RewardFileNotFoundError"),
    ]
    stats = job_stats(results, dataset="ds", agent="oracle")
    evals = stats.evals["oracle__ds"]
    assert evals.metrics == [{"mean": 0.5}]  # the errored trial is not in the denominator
    assert evals.n_trials == 2 and evals.n_errors == 1
    assert evals.exception_stats == {"RewardFileNotFoundError": ["t3__a"]}
    assert evals.reward_stats == {"reward": {"1.0": ["t1__a"], "0.0": ["t2__a"]}}
    assert stats.n_completed_trials == 3 and stats.n_errored_trials == 1


def test_mean_with_several_keys_counts_missing_as_zero() -> None:
    assert mean_metric([{"a": 1, "b": 1}, {"a": 0}]) == {"a": 0.5, "b": 0.5}


def test_pass_at_k_matches_harbor() -> None:
    results = [result("t1", f"t1__{i}", {"reward": float(i < 1)}) for i in range(4)]
    results += [result("t2", f"t2__{i}", {"reward": 1.0}) for i in range(4)]
    got = pass_at_k(results)
    assert set(got) == {2, 4}
    # t1: 1 success of 4 -> pass@2 = 1 - C(3,2)/C(4,2) = 0.5; t2 always passes.
    assert got[2] == pytest.approx((0.5 + 1.0) / 2)
    assert got[4] == pytest.approx(1.0)
    assert pass_at_k([result("t", "x", {"reward": 0.5})]) == {}


def test_archive_extraction_refuses_escapes(tmp_path: Path) -> None:
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("logs/ok.txt", "logs/../../escape.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
        link = tarfile.TarInfo("logs/link")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
    extract_archive(buffer.getvalue(), tmp_path / "out")
    assert (tmp_path / "out" / "ok.txt").read_text() == "hi"
    assert not (tmp_path / "escape.txt").exists()
    assert not (tmp_path / "out" / "link").exists()
    roundtrip = build_archive([ArchiveEntry("/a", None, 0o755), ArchiveEntry("/a/b.txt", b"x")])
    extract_archive(roundtrip, tmp_path / "rt", strip=0)
    assert (tmp_path / "rt" / "a" / "b.txt").read_text() == "x"
