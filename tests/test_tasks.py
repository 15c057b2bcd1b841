"""The task model: task.toml fields and defaults, loading errors, discovery."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.errors import DatasetError, TaskConfigError, TaskError, UnsafeTaskPathError
from harbor_exec.tasks.config import NetworkMode, parse_task_config, strip_canary
from harbor_exec.tasks.discovery import discover_tasks, task_dir_for_id
from harbor_exec.tasks.task import load_task
from tests.task_factory import make_task

EXAMPLES = Path(__file__).resolve().parent.parent / "tasks_examples" / "dataset"


def test_defaults_match_harbor_0_26() -> None:
    config = parse_task_config("", task="t")
    assert config.schema_version == "1.4"
    assert config.agent.timeout_sec is None  # no agent timeout unless set
    assert config.verifier.timeout_sec == 600.0
    env = config.environment
    assert env.build_timeout_sec == 600.0
    assert (env.cpus, env.memory_mb, env.storage_mb, env.docker_image) == (None, None, None, None)
    assert env.network_mode is NetworkMode.PUBLIC and env.os == "linux"
    assert config.solution.env == {} and config.metadata == {}


def test_deprecated_keys_are_converted() -> None:
    config = parse_task_config(
        'version = "1.0"\n[environment]\nallow_internet = false\nmemory = "2G"\nstorage = "10G"\n',
        task="t",
    )
    assert config.schema_version == "1.0"
    assert config.environment.network_mode is NetworkMode.NO_NETWORK
    assert config.environment.memory_mb == 2048
    assert config.environment.storage_mb == 10240
    # An explicit network_mode wins over allow_internet, as in Harbor.
    explicit = parse_task_config(
        '[environment]\nallow_internet = false\nnetwork_mode = "public"\n', task="t"
    )
    assert explicit.environment.network_mode is NetworkMode.PUBLIC


def test_unknown_keys_are_ignored_like_harbor() -> None:
    config = parse_task_config("[environment]\nfuture_key = 1\n[brand_new]\nx = 2\n", task="t")
    assert config.environment.cpus is None


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ('[environment]\ncpus = "lots"\n', "[environment].cpus"),
        ("[verifier]\ntimeout_sec = [1]\n", "[verifier].timeout_sec"),
        ('[task]\nname = "no-slash"\n', "[task].name"),
        ('[environment]\nnetwork_mode = "sometimes"\n', "[environment].network_mode"),
        ('[environment]\nmemory = "lots"\n', "[environment]"),
        # A timeout that is not positive would run and end as "past its -1s timeout".
        ("[agent]\ntimeout_sec = -1\n", "[agent].timeout_sec"),
        ("[verifier]\ntimeout_sec = 0\n", "[verifier].timeout_sec"),
        ("[environment]\nbuild_timeout_sec = -3\n", "[environment].build_timeout_sec"),
        ('[[steps]]\nname = "a"\n[steps.agent]\ntimeout_sec = -2\n', "timeout_sec"),
    ],
)
def test_bad_fields_are_named(toml: str, field: str) -> None:
    with pytest.raises(TaskConfigError) as caught:
        parse_task_config(toml, task="my-task")
    message = str(caught.value)
    assert "my-task/task.toml" in message and field in message


def test_invalid_toml_names_the_file_and_line() -> None:
    with pytest.raises(TaskConfigError, match=r"my-task/task.toml: not valid TOML.*line 2"):
        parse_task_config("[agent]\ntimeout_sec = = 3\n", task="my-task")


def test_canary_lines_are_stripped() -> None:
    text = "<!-- BENCHMARK canary GUID 1234 -->\n# terminal-bench-canary x\n\n\nDo it.\n# not a canary\n"
    assert strip_canary(text) == "Do it.\n# not a canary\n"
    assert load_task(EXAMPLES / "hello-shell").instruction.startswith("Create the file")


def test_missing_parts_are_named(tmp_path: Path) -> None:
    task = make_task(tmp_path, "t1")
    (task / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match=r"t1/tests/test.sh"):
        load_task(task)
    task = make_task(tmp_path, "t2")
    (task / "instruction.md").unlink()
    with pytest.raises(TaskError, match=r"t2/instruction.md"):
        load_task(task)
    task = make_task(tmp_path, "t3")
    (task / "environment" / "Dockerfile").unlink()
    with pytest.raises(TaskError, match=r"t3/environment/Dockerfile"):
        load_task(task)


def test_task_name_from_package_info(tmp_path: Path) -> None:
    task = make_task(tmp_path, "dir-name", toml='[task]\nname = "org/pretty-name"\n')
    assert load_task(task).name == "org/pretty-name"
    assert load_task(make_task(tmp_path, "plain")).name == "plain"


def test_symlink_inside_the_task_is_fine_outside_is_refused(tmp_path: Path) -> None:
    task = make_task(tmp_path, "links")
    (task / "tests" / "helper.sh").symlink_to(task / "solution" / "solve.sh")
    load_task(task)
    (task / "environment" / "secret").symlink_to("/etc/passwd")
    with pytest.raises(UnsafeTaskPathError, match=r"links/environment/secret"):
        load_task(task)


def test_discovery_sorted_and_reports_broken(tmp_path: Path) -> None:
    make_task(tmp_path, "b-task")
    make_task(tmp_path, "a-task")
    (tmp_path / "not-a-task").mkdir()
    broken = make_task(tmp_path, "c-broken")
    (broken / "task.toml").write_text('[environment]\ncpus = "x"\n')
    found = discover_tasks(tmp_path)
    assert [t.name for t in found.tasks] == ["a-task", "b-task"]
    assert len(found.broken) == 1 and "[environment].cpus" in str(found.broken[0])
    # A valid task directory is itself the whole dataset.
    assert [t.name for t in discover_tasks(tmp_path / "a-task").tasks] == ["a-task"]
    with pytest.raises(DatasetError, match="no Harbor task"):
        discover_tasks(tmp_path / "not-a-task")


def test_examples_are_all_valid() -> None:
    found = discover_tasks(EXAMPLES)
    assert not found.broken
    assert len(found.tasks) >= 6


@pytest.mark.parametrize("bad", ["", "../x", "/etc", "a/../../x", "\0"])
def test_task_ids_cannot_escape(tmp_path: Path, bad: str) -> None:
    with pytest.raises(DatasetError, match="harbor_task_id"):
        task_dir_for_id(tmp_path, bad)
    assert task_dir_for_id(tmp_path, "ok-task") == (tmp_path / "ok-task").resolve()


def test_environment_digest_tracks_content(tmp_path: Path) -> None:
    first = load_task(make_task(tmp_path, "d1")).environment_digest()
    same = load_task(make_task(tmp_path, "d2")).environment_digest()
    other = load_task(
        make_task(tmp_path, "d3", dockerfile="FROM debian:bookworm-slim\n")
    ).environment_digest()
    assert first == same != other


def test_the_task_format_loads_no_network_stack_and_nothing_above_it() -> None:
    """Every module of ``harbor_exec.tasks``, imported alone: no h11, httpcore or httpx,
    and no part of harbor_exec above the task format (the trial, agents, network)."""
    code = (
        "import sys\n"
        "import harbor_exec.tasks.config, harbor_exec.tasks.discovery, harbor_exec.tasks.hosts\n"
        "import harbor_exec.tasks.snapshots, harbor_exec.tasks.task\n"
        "third = [m for m in ('h11', 'httpcore', 'httpx') if m in sys.modules]\n"
        "above = sorted({m.split('.')[1] for m in sys.modules if m.startswith('harbor_exec.')}\n"
        "    - {'tasks', 'errors', 'cache'})\n"
        "print(third, above)"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[] []"


def test_a_misspelled_key_is_warned_about_with_the_key_it_meant(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Harbor ignores unknown keys, so `timeout_secs` would silently keep the default:
    still accepted, but said, with the closest known key."""
    toml = (
        '[agent]\ntimeout_secs = 30\n[environment]\ncpu = 2\nmemory = "1G"\n'
        '[[steps]]\nname = "a"\n[steps.verifier]\ntimout_sec = 5\n[metadata]\nanything = 1\n'
    )
    with caplog.at_level(logging.WARNING, logger="harbor_exec.tasks"):
        config = parse_task_config(toml, task="my-task")
    assert config.agent.timeout_sec is None  # ignored, as Harbor ignores it
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "task my-task/task.toml: unknown key [agent].timeout_secs (did you mean timeout_sec?); "
        "ignored, as Harbor ignores it",
        "task my-task/task.toml: unknown key [environment].cpu (did you mean cpus?); "
        "ignored, as Harbor ignores it",
        "task my-task/task.toml: unknown key [steps #1.verifier].timout_sec (did you mean "
        "timeout_sec?); ignored, as Harbor ignores it",
    ]


def test_every_key_harbor_reads_is_known() -> None:
    """No valid Harbor 0.26 key is called unknown: every field of Harbor's own models
    is one ``unknown_keys`` knows (where ours keep a table as free-form, below it too)."""
    from harbor.models.task.config import TaskConfig as HarborTaskConfig
    from pydantic import BaseModel

    from harbor_exec.tasks.config import TaskConfig, model_in, unknown_keys

    def sample(model: type[BaseModel]) -> dict[str, Any]:
        table: dict[str, Any] = {}
        for name, field in model.model_fields.items():
            sub = model_in(field.annotation)
            table[name] = sample(sub) if sub is not None and sub is not model else 1
        return table

    assert unknown_keys(TaskConfig, sample(HarborTaskConfig)) == []
