"""The commands' options: every name shown whole in an 80-column help, and every option
two commands share declared once, in ``harbor_exec/cli/options.py``."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.models import OptionInfo
from typer.testing import CliRunner

from harbor_exec.cli import options
from harbor_exec.cli.app import app

COMMANDS = ("validate", "run", "serve", "prewarm")

#: Options more than one of the commands take, each declared once in ``cli/options.py``.
SHARED = {
    "--dataset": {"validate", "run"},
    "--task": {"validate", "run"},
    "--package-source": {"validate", "run", "serve"},
    "--registry-path": {"validate", "run"},
    "--registry-url": {"validate", "run"},
    "--task-git-allow-unpinned": {"validate", "run", "serve"},
    "--n-concurrent": {"validate", "run", "prewarm"},
    "--n-attempts": {"validate", "run"},
    "--jobs-dir": {"validate", "run"},
    "--job-name": {"validate", "run"},
    "--include-task-name": {"validate", "run"},
    "--exclude-task-name": {"validate", "run"},
    "--n-tasks": {"validate", "run"},
    "--verifier-mode": {"validate", "run", "serve"},
    "--default-cpus": {"validate", "run", "serve"},
    "--command-channel": {"validate", "run", "serve"},
    "--warm-containers": {"validate", "run", "serve"},
    "--warm-memory-mb": {"validate", "run", "serve"},
    "--default-memory-mb": {"validate", "run", "serve"},
    "--default-storage-mb": {"validate", "run", "serve"},
    "--default-shm-mb": {"validate", "run", "serve"},
    "--default-nofile": {"validate", "run", "serve"},
    "--max-log-bytes": {"validate", "run", "serve"},
    "--ray": {"validate", "serve", "prewarm"},
    "--agent": {"run", "serve", "prewarm"},
    "--model-name": {"run", "serve"},
    "--api-key-env": {"run", "serve"},
    "--agent-kwarg": {"run", "serve"},
    "--agent-setup-timeout-sec": {"run", "serve"},
    "--package-cache": {"validate", "run", "serve", "prewarm"},
    "--max-retries": {"validate", "run"},
    "--package-cache-max-gb": {"validate", "run", "serve", "prewarm"},
    "--package-cache-dir": {"validate", "run", "serve", "prewarm"},
    "--package-cache-host": {"validate", "run", "serve", "prewarm"},
}
#: Shared names whose meaning differs by command (one declaration per meaning, all in
#: ``cli/options.py``, except ``--api-key-env``: the model's key for ``run``, the
#: server's bearer key for ``serve``, each declared by its command), and prewarm's
#: ``-n``/``--n-concurrent``, an alias of its ``--jobs``.
DIFFERENT_MEANINGS = {
    "--agent",
    "--model-name",
    "--api-key-env",
    "--agent-setup-timeout-sec",
    "--task-git-allow-unpinned",
    "--n-concurrent",
}
COMMAND_OWN = {("--api-key-env", "run"), ("--api-key-env", "serve"), ("--n-concurrent", "prewarm")}


def _commands() -> dict[str, Any]:
    group = typer.main.get_group(app)
    return {name: group.commands[name] for name in COMMANDS}


def _declarations() -> dict[str, dict[str, OptionInfo]]:
    """Per option name, per command: the ``typer.Option`` that declares it."""
    found: dict[str, dict[str, OptionInfo]] = {}
    for name, command in _commands().items():
        hints = typing.get_type_hints(command.callback, include_extras=True)
        for param in command.params:
            infos = [
                meta
                for meta in getattr(hints[param.name], "__metadata__", ())
                if isinstance(meta, OptionInfo)
            ]
            for spelled in param.opts:
                if spelled.startswith("--") and infos:
                    found.setdefault(spelled, {})[name] = infos[0]
    return found


def _from_options_module() -> set[int]:
    # The module's own declarations, and the ones it makes of ``SandboxConfig``'s fields.
    declared = [*vars(options).values(), *(decl for decl, _ in options.SANDBOX_OPTIONS.values())]
    return {
        id(meta)
        for value in declared
        for meta in getattr(value, "__metadata__", ())
        if isinstance(meta, OptionInfo)
    }


def test_the_shared_options_are_the_ones_listed() -> None:
    shared = {opt: set(by) for opt, by in _declarations().items() if len(by) > 1}
    assert shared == SHARED


@pytest.mark.parametrize("option", sorted(SHARED))
def test_a_shared_option_is_declared_once_in_the_options_module(option: str) -> None:
    by_command = _declarations()[option]
    declared_here = _from_options_module()
    for command, info in by_command.items():
        if (option, command) not in COMMAND_OWN:
            assert id(info) in declared_here, f"{command} {option} is declared outside options.py"
    if option not in DIFFERENT_MEANINGS:
        assert len({id(info) for info in by_command.values()}) == 1, option


@pytest.mark.parametrize("command", COMMANDS)
def test_an_80_column_help_shows_every_option_name_whole(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    shown = set(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", result.output))
    for param in _commands()[command].params:
        for name in (*param.opts, *param.secondary_opts):
            if name.startswith("-"):
                assert name in shown, f"{command} --help cuts {name}"


def test_the_sandbox_options_make_one_sandbox_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve``'s sandbox and limits options arrive as one ``SandboxConfig``; none given,
    it is ``SandboxConfig()``'s defaults."""
    import harbor_exec.server.run as server_run
    from harbor_exec.backends.harbor.config import SandboxConfig
    from harbor_exec.cli import serve

    seen: list[serve.ServeOptions] = []
    monkeypatch.setattr(serve, "build_app", lambda options, api_key: seen.append(options))
    monkeypatch.setattr(server_run, "serve_app", lambda *args, **kwargs: kwargs["listener"].close())
    asked = ["--verifier-mode", "separate", "--grader-verifier-mode", "shared"]
    asked += ["--default-cpus", "1.5", "--default-nofile", "999", "--max-log-bytes", "2048"]
    for args in (
        ["serve", "--tasks-dir", ".", "--port", "0"],
        ["serve", "--tasks-dir", ".", "--port", "0", *asked],
    ):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    default, given = (options.sandbox for options in seen)
    assert default == SandboxConfig()
    assert (given.verifier_mode, given.grader_verifier_mode) == ("separate", "shared")
    assert (given.default_cpus, given.default_nofile) == (1.5, 999)
    assert given.output.max_file_bytes == 2048
    assert given.default_memory_mb == SandboxConfig().default_memory_mb


def test_a_sandbox_option_is_a_field_of_the_config_and_one_of_the_policy() -> None:
    """A new sandbox option touches two places: a ``SandboxConfig`` field that says how
    the command line gives it (every command that runs trials then has it) and the
    ``SandboxPolicy`` field of the same name the trial reads (``policy`` copies it)."""
    import dataclasses

    from harbor_exec.backends.harbor.config import SandboxConfig
    from harbor_exec.sandbox.archives import OutputLimits
    from harbor_exec.trial.policy import SandboxPolicy

    commands = _commands()
    for config_field in dataclasses.fields(SandboxConfig):
        cli = config_field.metadata.get("cli")
        if cli is None:
            continue
        for command in ("validate", "run", "serve"):
            if command != "serve" and cli.grader_only:
                continue
            flags = {
                name
                for param in commands[command].params
                for name in (*param.opts, *param.secondary_opts)
            }
            for flag in cli.flag.split("/"):
                assert flag in flags, f"{command} lacks {flag} ({config_field.name})"
    asked = SandboxConfig(
        verifier_mode="separate",
        grader_verifier_mode="shared",
        default_cpus=0.5,
        default_memory_mb=300,
        default_storage_mb=400,
        default_shm_mb=7,
        default_nofile=77,
        output=OutputLimits(max_file_bytes=5000),
        pids_limit=99,
        override_cpus=3.0,
        override_memory_mb=900,
        override_storage_mb=800,
        deps_in_image=True,
        command_channel=False,
    )
    policy = asked.policy(max_concurrent_trials=1, pid_max=4096)
    shared = {f.name for f in dataclasses.fields(SandboxPolicy)} & {
        f.name for f in dataclasses.fields(SandboxConfig)
    }
    # Every field of the config reaches the policy under its own name.
    assert shared == {f.name for f in dataclasses.fields(SandboxConfig)}
    for name in shared:
        assert getattr(policy, name) == getattr(asked, name), name
    assert policy != SandboxPolicy(pids_limit=99)


def test_help_falls_back_to_typers_panels_when_its_internals_moved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The panels read typer's private code: a typer where it moved (0.29 dropped
    ``make_metavar`` from its options) still prints every option, never a traceback."""
    from harbor_exec.cli import help as cli_help

    def moved(param: Any, ctx: Any) -> Any:
        raise AttributeError("'TyperOption' object has no attribute 'make_metavar'")

    monkeypatch.setattr(cli_help, "_types", moved)
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "--tasks-dir" in result.output and "--package-cache-max-gb" in result.output


def test_serve_imports_the_workflow_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`harbor-exec serve --workflow my_rollout.workflow:Answer` from the project's own
    directory finds it, as uvicorn finds an app (its --app-dir, default "."), without
    PYTHONPATH; `--app-dir` names another directory."""
    import sys

    import harbor_exec.server.run as server_run

    package = tmp_path / "project" / "my_rollout"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "workflow.py").write_text(
        "from harbor_exec.authoring import AgentWorkflow\n\n"
        "class Answer(AgentWorkflow):\n"
        "    async def run(self, ctx):\n"
        "        return [{'role': 'assistant', 'content': '4'}]\n"
    )
    served: list[Any] = []

    def serve_app(app: Any, **kwargs: Any) -> None:
        kwargs["listener"].close()
        served.append(app)

    monkeypatch.setattr(server_run, "serve_app", serve_app)
    monkeypatch.setattr(sys, "path", list(sys.path))  # serve puts the app dir first
    monkeypatch.delitem(sys.modules, "my_rollout", raising=False)
    monkeypatch.delitem(sys.modules, "my_rollout.workflow", raising=False)
    monkeypatch.chdir(package.parent)
    args = ["serve", "--workflow", "my_rollout.workflow:Answer", "--port", "0"]
    result = CliRunner().invoke(app, [*args, "--data-dir", str(tmp_path / "d1")])
    assert result.exit_code == 0, result.output
    assert len(served) == 1 and sys.modules["my_rollout.workflow"].__file__ == str(
        package / "workflow.py"
    )
    # From elsewhere, --app-dir names it.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(package.parent)])
    for name in ("my_rollout", "my_rollout.workflow"):
        monkeypatch.delitem(sys.modules, name)
    result = CliRunner().invoke(
        app, [*args, "--app-dir", str(package.parent), "--data-dir", str(tmp_path / "d2")]
    )
    assert result.exit_code == 0, result.output
    assert len(served) == 2


def test_serve_says_a_port_in_use_before_it_builds_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    from harbor_exec.cli import serve

    built: list[Any] = []
    monkeypatch.setattr(serve, "build_app", lambda options, api_key: built.append(options))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["serve", "--workflow", "tests.server_utils:ScriptedWorkflow", "--port", str(port)]
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output
    assert "--port" in result.output and built == []  # no backend, no prewarm started


def test_harbors_task_filters_pick_the_tasks(tmp_path: Path) -> None:
    """-i/--include-task-name and -x/--exclude-task-name (globs, repeatable) and
    -l/--n-tasks, applied as Harbor applies them: filters first, then the limit."""
    import typer

    from harbor_exec.cli.helpers import filter_tasks, select_dataset
    from tests.task_factory import make_task

    for name in ("alpha-1", "alpha-2", "beta-1", "gamma"):
        make_task(tmp_path / "ds", name)
    selected = select_dataset(tmp_path / "ds", None, None, None, False)

    def names(**filters: Any) -> list[str]:
        picked = filter_tasks(
            selected, filters.get("include"), filters.get("exclude"), filters.get("n_tasks")
        )
        return [t.name for t in picked.discovery.tasks]

    assert names() == ["alpha-1", "alpha-2", "beta-1", "gamma"]
    assert names(include=["alpha-*"]) == ["alpha-1", "alpha-2"]
    assert names(include=["alpha-*", "gamma"], exclude=["*-2"]) == ["alpha-1", "gamma"]
    assert names(exclude=["alpha-*"], n_tasks=1) == ["beta-1"]
    with pytest.raises(typer.Exit):
        names(include=["delta*"])


def test_the_help_renderer_is_imported_only_for_help() -> None:
    """typer's rich help (with the markdown it pulls in, about 80 ms) is imported when help
    is printed, not by every command's start-up; the first help of a fresh process still
    has our panels (every name whole at 80 columns)."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from harbor_exec.cli.app import app\n"
        "print('at start-up:', 'typer.rich_utils' in sys.modules)\n"
        "result = CliRunner().invoke(app, ['serve', '--help'], env={'COLUMNS': '80'}, "
        "terminal_width=80)\n"
        "print(result.output)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert "at start-up: False" in done.stdout, done.stdout
    assert (
        "--task-git-allow-unpinned" in done.stdout and "--no-task-git-allow-unpinned" in done.stdout
    )
