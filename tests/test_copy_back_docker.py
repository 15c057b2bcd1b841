"""The verdict is read first, on its own budget: floods in what the agent leaves in
``/logs`` cannot erase the verifier's 0 (a dodged 0 would raise a job's mean), cost
the host minutes or gigabytes, or spend the verifier's timeout. Each attack is a
task whose ``test.sh`` writes 0, run in both verifier modes on the real engine."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from harbor_exec.sandbox.archives import OutputLimits
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from tests.task_factory import make_task

# engine_lane: its own tasks, counts only its own containers, time bounds with wide margins.
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

BUDGET = OutputLimits().max_total_bytes
SLACK = 64 * 2**20  # directory blocks (10,000 at most), result.json, the verifier's part
TIME_BOUND_SEC = 90.0

ATTACKS = {
    # 260 MiB of zeros: more bytes than the whole budget.
    "zeros-260m": "fallocate -l 260M /logs/artifacts/zeros || head -c 272629760 /dev/zero > /logs/artifacts/zeros",
    # 10,000 empty files (with oracle.txt, one over the file budget).
    "files-10k": "cd /logs/artifacts && seq -f 'f%05g' 1 10000 | xargs touch",
    # 30,000 empty directories (three times the directory budget, past the entries'
    # too): none of them regular files.
    "dirs-30k": "cd /logs/artifacts && seq -f 'd%06g' 1 30000 | xargs mkdir",
    # One path of 4,090 bytes: legal in the container, longer than the host's PATH_MAX
    # below the trial directory.
    "path-4090": """
        part=$(head -c 250 /dev/zero | tr '\\0' a)
        p=/logs/artifacts
        while [ $(( ${#p} + 252 )) -lt 4090 ]; do p=$p/$part; done
        mkdir -p "$p"
        leaf=$(head -c $(( 4090 - ${#p} - 1 )) /dev/zero | tr '\\0' b)
        echo x > "$p/$leaf"
        [ ${#p} -gt 3800 ] && [ -f "$p/$leaf" ] || exit 3
    """,
}
OVER_BUDGET = {"zeros-260m": "bytes", "files-10k": "files", "dirs-30k": "dirs"}


def disk_usage(root: Path) -> int:
    """Bytes the tree takes on disk, directories included."""
    total = 0
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


def run_attack(
    runtime: DockerRuntime, tmp_path: Path, name: str, solve: str, mode: str, **verifier: float
) -> tuple[TrialResult, Path, float]:
    toml = (
        f"[agent]\ntimeout_sec = 120.0\n[verifier]\ntimeout_sec = {verifier.get('timeout', 30.0)}\n"
    )
    task = make_task(
        tmp_path, name, solve=solve, test="echo 0 > /logs/verifier/reward.txt", toml=toml
    )
    request = TrialRequest(TrialSpec(task=load_task(task), trials_dir=tmp_path / "trials"))
    request.spec = replace(request.spec, policy=SandboxPolicy(verifier_mode=mode))  # type: ignore[arg-type]
    started = time.monotonic()
    result = run_trial(runtime, request)
    return result, tmp_path / "trials" / result.trial_name, time.monotonic() - started


@pytest.mark.parametrize("mode", ["shared", "separate"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_agent_floods_leave_the_verifiers_zero_standing(
    docker_runtime: DockerRuntime, tmp_path: Path, attack: str, mode: str
) -> None:
    result, out, elapsed = run_attack(docker_runtime, tmp_path, attack, ATTACKS[attack], mode)
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == {"reward": 0.0}, result.exception_info
    assert result.reward_valid and result.reward == 0.0
    assert result.verifier_environment_mode == mode
    notes = json.loads((out / "copy-back.json").read_text())
    if attack in OVER_BUDGET:
        assert result.exception_type == "AgentOutputLimitError", result.exception_info
        assert notes["agent"]["exceeded"] == OVER_BUDGET[attack]
    else:  # nothing over budget: the path the host cannot hold is skipped and noted
        # The disk watch fails closed on a path too deep for the host to measure, if
        # one of its walks lands while the agent still runs: nothing else may go wrong.
        info = result.exception_info
        assert info is None or (
            info.exception_type == "DiskBudgetExceededError"
            and "paths too deep to measure" in info.exception_message
        ), info
        assert notes["agent"]["skipped_count"] >= 1
        assert any("longer than" in line for line in notes["agent"]["skipped"])
    assert disk_usage(out) < BUDGET + SLACK
    assert elapsed < TIME_BOUND_SEC, f"{attack} took {elapsed:.0f}s"
    assert not docker_runtime.our_containers(owner=docker_runtime.owner)


@pytest.mark.parametrize(
    "attack",
    [
        "truncate -s 3G /logs/artifacts/zeros",  # 3 GiB of zeros on the wire (a sparse file)
        "cd /logs/artifacts && seq -f 'd%06g' 1 30000 | xargs mkdir",
    ],
    ids=["zeros-3g", "dirs-30k"],
)
def test_the_hand_over_is_not_charged_to_a_separate_verifier(
    docker_runtime: DockerRuntime, tmp_path: Path, attack: str
) -> None:
    result, out, elapsed = run_attack(
        docker_runtime, tmp_path, "handover", attack, "separate", timeout=5.0
    )
    assert result.exception_type == "AgentOutputLimitError", result.exception_info
    assert result.reward_valid and result.reward == 0.0
    assert result.verifier is not None and (result.verifier.seconds or 0) < 30
    assert disk_usage(out) < BUDGET + SLACK
    assert elapsed < TIME_BOUND_SEC
