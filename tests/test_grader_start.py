"""Where and how the bundled grader starts, without an engine: the verifier mode it
gets by default, its isolated interpreter, and its own fresh copy of the bundle.
(``tests/test_grader_isolation.py`` runs the attacks in real containers.)"""

from __future__ import annotations

import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.backends.harbor.config import SandboxConfig
from harbor_exec.container import runner
from harbor_exec.container.exchange import (
    GRADER_CODE_DIR,
    GRADER_DIR,
    GRADER_MANIFEST_PATH,
    GRADER_WORKDIR,
    MANIFEST_PATH,
    USER_CODE_DIR,
)
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import Trial, TrialRequest
from harbor_exec.trial.verifiers import GRADER_TEST_SH, grader_bundle_files, grader_verifier
from harbor_exec.trial.verifiers import tests_verifier as task_tests_verifier
from tests.fake_runtime import FakeRuntime
from tests.task_factory import make_task

BUNDLE = [
    ArchiveEntry(MANIFEST_PATH, b"{}", 0o644),
    ArchiveEntry(f"{USER_CODE_DIR}/pkg/__init__.py", b"", 0o644),
    ArchiveEntry(f"{USER_CODE_DIR}/pkg/grader.py", b"X = 1\n", 0o644),
]


def mode_of(tmp_path: Path, *, grader: bool, toml: str | None = None, **policy: object) -> str:
    task = load_task(make_task(tmp_path / "tasks", "t", **({"toml": toml} if toml else {})))
    verifier = (
        grader_verifier(b"{}", BUNDLE) if grader else task_tests_verifier(task.tests_dir, b"{}")
    )
    request = TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "trials"), verifier=verifier)
    request.spec = replace(request.spec, policy=SandboxPolicy(**policy))  # type: ignore[arg-type]
    return Trial(FakeRuntime(), request).verifier_mode


def test_a_bundled_grader_verifies_in_a_separate_container_by_default(tmp_path: Path) -> None:
    assert mode_of(tmp_path, grader=True) == "separate"
    # Even where the task asks for shared mode: only the operator can ask for it.
    shared_task = '[verifier]\nenvironment_mode = "shared"\n'
    assert mode_of(tmp_path, grader=True, toml=shared_task) == "separate"
    assert mode_of(tmp_path, grader=True, grader_verifier_mode="shared") == "shared"
    # A task's own tests keep the task's mode (Harbor's default: shared).
    assert mode_of(tmp_path, grader=False) == "shared"
    assert mode_of(tmp_path, grader=False, verifier_mode="separate") == "separate"


def test_serve_and_harbor_backend_default_to_the_separate_grader(tmp_path: Path) -> None:
    assert SandboxConfig().policy(max_concurrent_trials=1, pid_max=4096).grader_verifier_mode == (
        "separate"
    )
    asked = SandboxConfig(grader_verifier_mode="shared")
    assert asked.policy(max_concurrent_trials=1, pid_max=4096).grader_verifier_mode == "shared"
    backend = HarborBackend(tasks_dir=tmp_path, runtime=FakeRuntime())
    assert backend.policy.grader_verifier_mode == "separate"
    shared = HarborBackend(tasks_dir=tmp_path, runtime=FakeRuntime(), grader_verifier_mode="shared")
    assert shared.policy.grader_verifier_mode == "shared"
    with pytest.raises(ValueError, match="grader_verifier_mode"):
        HarborBackend(tasks_dir=tmp_path, grader_verifier_mode="task")  # type: ignore[arg-type]


def test_the_grader_gets_a_fresh_copy_of_the_bundle_of_its_own() -> None:
    entries = grader_bundle_files(BUNDLE)
    assert entries[0] == ArchiveEntry(GRADER_DIR, None, 0o755, fresh=True)
    paths = [entry.path for entry in entries]
    assert GRADER_WORKDIR in paths and GRADER_MANIFEST_PATH in paths
    assert f"{GRADER_CODE_DIR}/pkg/grader.py" in paths
    assert not any(path.startswith((USER_CODE_DIR, MANIFEST_PATH)) for path in paths)
    with pytest.raises(ValueError, match="outside"):
        grader_bundle_files([ArchiveEntry("/etc/passwd", b"", 0o644)])


def test_the_grader_starts_isolated_from_an_empty_directory() -> None:
    command = GRADER_TEST_SH.replace("\\\n", " ")
    assert f"cd {GRADER_WORKDIR} " in command
    assert " -I -m harbor_exec.container.runner grade " in command
    assert f"--code-dir {GRADER_CODE_DIR}" in command
    assert f"--manifest {GRADER_MANIFEST_PATH}" in command
    assert "PYTHONPATH" not in command


def test_code_dir_is_appended_after_the_runners_own_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--code-dir`` comes after the standard library and site-packages: nothing in
    it shadows the runner's own modules."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    seen: list[list[str]] = []

    def run_grade(paths: object) -> int:
        seen.append(list(sys.path))
        return 0

    monkeypatch.setattr(runner, "run_grade", run_grade)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    before = list(sys.path)
    assert runner.main(["grade", "--code-dir", str(tmp_path)]) == 0
    assert seen == [[*before, str(tmp_path)]]
