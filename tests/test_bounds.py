"""Bad input ends in a clear error, never a crash: reward values, request bounds,
and the osmosis environment variables a drop-in server must honour."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.agents.base import AgentInfo
from harbor_exec.backends.base import default_artifact_root
from harbor_exec.errors import VerifierOutputParseError
from harbor_exec.jobs.dataset import (
    JobOutcome,
    failure_reason,
    is_full_reward,
    job_stats,
    summary_rows,
)
from harbor_exec.protocol import MAX_ROLLOUT_ID_CHARS, rollout_dir_name
from harbor_exec.server.run import resolve_port
from harbor_exec.trial.results import TrialResult, VerifierResult, parse_rewards
from tests.server_utils import CHAT_URL, PROMPT, local_app, serve, wait_until

# --------------------------------------------------------------------------- rewards


@pytest.mark.parametrize("digits", [401, 5001])
def test_huge_integer_reward_is_a_parse_error_naming_the_key(tmp_path: Path, digits: int) -> None:
    (tmp_path / "reward.json").write_text('{"reward": 1, "score": ' + "9" * digits + "}")
    with pytest.raises(VerifierOutputParseError, match="score"):
        parse_rewards(tmp_path)


def test_huge_reward_txt_is_a_parse_error(tmp_path: Path) -> None:
    (tmp_path / "reward.txt").write_text("9" * 5001)
    with pytest.raises(VerifierOutputParseError, match="reward"):
        parse_rewards(tmp_path)


def result_with(rewards: dict[str, Any] | None, name: str = "t") -> TrialResult:
    return TrialResult(
        task_name=name,
        trial_name=f"{name}__abc",
        trial_uri="file:///x",
        task_id={"path": "/x"},
        task_checksum="0",
        config={},
        agent_info=AgentInfo(name="oracle", version="1.0.0"),
        verifier_result=VerifierResult(rewards=rewards) if rewards is not None else None,
        started_at=datetime.now(UTC),
        finished_at=datetime.now(UTC),
    )


def test_job_stats_never_raise_on_odd_rewards() -> None:
    # Results read back from disk (a resumed job) may hold anything.
    odd = result_with({"reward": 10**500})
    stats = job_stats([odd, result_with({"reward": 1.0}, "u")], dataset="d", agent="oracle")
    assert stats.evals["oracle__d"].n_trials == 2
    assert "invalid" in stats.evals["oracle__d"].reward_stats["reward"]
    json.loads(stats.model_dump_json())


def test_reward_key_decides_pass_and_auxiliary_keys_do_not_fail() -> None:
    assert is_full_reward(result_with({"reward": 1, "partial_credit": 0.5}))
    assert not is_full_reward(result_with({"reward": 0.5, "partial_credit": 1.0}))
    assert is_full_reward(result_with({"a": 1.0, "b": 2}))
    assert not is_full_reward(result_with({"a": 1.0, "b": 0.5}))
    reason = failure_reason(result_with({"reward": 0.0, "extra": 1.0}))
    assert reason is not None and "reward key" in reason
    outcome = JobOutcome(
        job_dir=Path("."),
        results=[result_with({"reward": 1, "partial_credit": 0.5})],
        invalid_tasks=[],
        images_built=0,
        job_result=None,  # type: ignore[arg-type]
    )
    rows = summary_rows(outcome)
    assert rows[0]["passed"] and rows[0]["rewards"] == {"reward": 1, "partial_credit": 0.5}


# --------------------------------------------------------------------------- request bounds


def body(rollout_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "initial_messages": PROMPT,
        "rollout_id": rollout_id,
        "chat_completions_url": CHAT_URL,
        "label": "4",
        **fields,
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("artifacts")
    app = local_app(root, result_wait_timeout_sec=1.0, max_timeout_sec=3600.0)
    with serve(app) as url:
        yield url, root


@pytest.mark.parametrize(
    "rollout_id",
    [
        "x" * (MAX_ROLLOUT_ID_CHARS + 1),
        "x" * 10_000,
        "a\nb",
        "a\rb",
        "a\tb",
        "a\x1bb",
        "a\x7fb",
        "a/b",
        "a\\b",
        "a\x00b",
        "..",
        "",
    ],
)
def test_bad_rollout_ids_are_422_naming_the_field(server: Any, rollout_id: str) -> None:
    url, _root = server
    response = httpx.post(f"{url}/rollout", json=body(rollout_id))
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "rollout_id"]
    assert "256" in error["msg"]


@pytest.mark.parametrize("field", ["agent_timeout_sec", "grader_timeout_sec"])
def test_timeouts_above_the_maximum_are_422(server: Any, field: str) -> None:
    url, _root = server
    response = httpx.post(f"{url}/rollout", json=body(uuid.uuid4().hex, **{field: 1e10}))
    assert response.status_code == 422
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", field] and "3600" in error["msg"]
    ok = httpx.post(f"{url}/rollout", json=body(uuid.uuid4().hex, **{field: 3600.0}))
    assert ok.status_code == 202


def test_default_timeout_maximum_is_a_day(tmp_path: Path) -> None:
    with serve(local_app(tmp_path)) as url:
        day = 24 * 3600.0
        assert (
            httpx.post(f"{url}/rollout", json=body("a", agent_timeout_sec=day)).status_code == 202
        )
        assert (
            httpx.post(f"{url}/rollout", json=body("b", agent_timeout_sec=day + 1)).status_code
            == 422
        )


def test_longest_accepted_id_is_stored_and_run(server: Any) -> None:
    """Everything accepted with 202 can be stored: 256 characters of 3-byte UTF-8
    would make a 768-byte file name, over every file system's limit."""
    url, root = server
    rollout_id = "é" * 128 + "字" * 128
    assert len(rollout_id) == MAX_ROLLOUT_ID_CHARS
    admitted = httpx.post(f"{url}/rollout", json=body(rollout_id))
    assert admitted.status_code == 202
    lease = admitted.json()["polling_lease_token"]
    final: dict[str, Any] = {}

    def finished() -> bool:
        answer = httpx.get(
            f"{url}/rollout/{rollout_id}/result", headers={"X-Osmosis-Rollout-Lease": lease}
        ).json()
        final.update(answer)
        return bool(answer["status"] == "success")

    assert wait_until(finished, timeout=10, interval=0.05)
    assert final["sample"]["reward"] == 1.0
    trajectory = root / rollout_dir_name(rollout_id) / "trajectory.json"
    assert wait_until(trajectory.is_file, timeout=10, interval=0.05)
    assert json.loads(trajectory.read_text())["session_id"] == rollout_id


def test_dir_names_are_unique_and_short() -> None:
    a, b = "x" * 255 + "a", "x" * 255 + "b"
    assert rollout_dir_name(a) != rollout_dir_name(b)
    assert len(rollout_dir_name(a).encode()) <= 200
    assert rollout_dir_name("plain-id") == "plain-id"


# --------------------------------------------------------------------------- osmosis env


def test_artifact_root_falls_back_to_osmosis_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("HARBOR_EXEC_ARTIFACT_ROOT", raising=False)
    monkeypatch.setenv("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", str(tmp_path / "osmosis"))
    assert default_artifact_root() == tmp_path / "osmosis"
    monkeypatch.setenv("HARBOR_EXEC_ARTIFACT_ROOT", str(tmp_path / "ours"))
    assert default_artifact_root() == tmp_path / "ours"  # our own setting wins


def test_port_falls_back_to_osmosis_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("_OSMOSIS_ROLLOUT_PORT", raising=False)
    assert resolve_port(None) == 8000
    monkeypatch.setenv("_OSMOSIS_ROLLOUT_PORT", "8123")
    assert resolve_port(None) == 8123
    assert resolve_port(9000) == 9000  # our own setting wins
    monkeypatch.setenv("_OSMOSIS_ROLLOUT_PORT", "eighty")
    with pytest.raises(ValueError, match="_OSMOSIS_ROLLOUT_PORT"):
        resolve_port(None)
