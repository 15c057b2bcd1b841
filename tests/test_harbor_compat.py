"""Our example tasks are tasks that the real Harbor 0.26 accepts, and the task model
agrees with Harbor on what it rejects. Runs Harbor itself from ``.venv-harbor``
(made by ``scripts/setup.sh``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harbor_exec.errors import TaskError
from harbor_exec.tasks.task import load_task
from tests.task_factory import make_task

ROOT = Path(__file__).resolve().parent.parent
HARBOR_PYTHON = ROOT / ".venv-harbor" / "bin" / "python"
EXAMPLE_TASKS = sorted(p for p in (ROOT / "tasks_examples").rglob("task.toml"))

_CHECK = """
import json, sys
from harbor.models.task.task import Task
out = {}
for path in sys.argv[1:]:
    try:
        task = Task(path)
        out[path] = {"valid": Task.is_valid_dir(path), "name": task.name,
                     "instruction": task.instruction,
                     "network_mode": task.config.environment.network_mode.value,
                     "memory_mb": task.config.environment.memory_mb,
                     "agent_timeout": task.config.agent.timeout_sec}
    except Exception as exc:
        out[path] = {"valid": False, "error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out))
"""


def harbor_view(*task_dirs: Path) -> dict[str, dict[str, object]]:
    if not HARBOR_PYTHON.exists():
        pytest.fail(".venv-harbor is missing: run scripts/setup.sh", pytrace=False)
    done = subprocess.run(
        [str(HARBOR_PYTHON), "-c", _CHECK, *map(str, task_dirs)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_every_example_task_is_accepted_by_harbor() -> None:
    dirs = [p.parent for p in EXAMPLE_TASKS if "workflow_project" not in p.parts]
    assert len(dirs) >= 7
    view = harbor_view(*dirs)
    for task_dir in dirs:
        harbor = view[str(task_dir)]
        assert harbor["valid"] is True, (task_dir, harbor)
        ours = load_task(task_dir)
        assert ours.name == harbor["name"]
        assert ours.instruction == harbor["instruction"]
        assert ours.config.environment.network_mode.value == harbor["network_mode"]
        assert ours.config.environment.memory_mb == harbor["memory_mb"]
        assert ours.config.agent.timeout_sec == harbor["agent_timeout"]


@pytest.mark.parametrize(
    "toml",
    [
        '[environment]\ncpus = "lots"\n',
        '[task]\nname = "no-slash"\n',
        '[environment]\nnetwork_mode = "sometimes"\n',
        "schema_version = [1]\n",
        "[agent]\ntimeout_sec = = 3\n",
    ],
)
def test_we_reject_what_harbor_rejects(tmp_path: Path, toml: str) -> None:
    task = make_task(tmp_path, "bad")
    (task / "task.toml").write_text(toml)
    assert harbor_view(task)[str(task)]["valid"] is False
    with pytest.raises(TaskError):
        load_task(task)
