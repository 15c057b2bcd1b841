"""``harbor-exec init task NAME`` and ``init project NAME``: a start that works as it
stands (``validate`` passes the task; the project bundles and serves), instead of a copy
of an example."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Annotated

import typer

from harbor_exec.cli.help import HelpCommand, HelpGroup
from harbor_exec.cli.helpers import console, usage_error

init_app = typer.Typer(
    cls=HelpGroup,
    help="Write a minimal Harbor task, or a workflow project laid out as osmosis-ai's.",
    no_args_is_help=True,
)

_NAME = re.compile(r"[a-z][a-z0-9-]*")

TASK_FILES = {
    "instruction.md": "Write the word `hello` into /app/answer.txt.\n",
    "task.toml": """\
        schema_version = "1.4"

        [agent]
        timeout_sec = 600.0

        [verifier]
        timeout_sec = 120.0

        [environment]
        cpus = 1
        memory_mb = 2048
        """,
    "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\n",
    "solution/solve.sh": """\
        #!/bin/bash
        # The oracle: what `harbor-exec validate` runs to prove the task can be solved.
        echo hello > /app/answer.txt
        """,
    "tests/test.sh": """\
        #!/bin/bash
        # The verifier: write the reward (a trainer reads the `reward` key) to
        # /logs/verifier/reward.txt (a number) or reward.json ({"reward": ...}).
        if [ "$(cat /app/answer.txt 2>/dev/null)" = "hello" ]; then
            echo 1 > /logs/verifier/reward.txt
        else
            echo 0 > /logs/verifier/reward.txt
        fi
        """,
}


def _project_files(name: str) -> dict[str, str]:
    package = name.replace("-", "_")
    return {
        "pyproject.toml": f"""\
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{name}"
            version = "0.1.0"
            requires-python = ">=3.12"
            dependencies = ["osmosis-ai==0.3.8", "httpx>=0.27"]

            [tool.setuptools.packages.find]
            where = ["src"]
            """,
        f"src/{package}/__init__.py": "",
        f"src/{package}/main.py": f'''\
            """The workflow, the grader and their configs in one module, as osmosis-ai's docs
            write them. Serve it over Harbor tasks with
                harbor-exec serve --tasks-dir TASK --code-dir . --agent {package}.main:Workflow
                    --grader {package}.main:Answer --workflow-config {package}.main:workflow_config
            (the grader verifies tasks without tests/; see docs/bundles.md)."""

            from __future__ import annotations

            from typing import Any

            import httpx
            from osmosis_ai.rollout import (
                AgentWorkflow,
                AgentWorkflowConfig,
                AgentWorkflowContext,
                AgentWorkflowOutput,
                Grader,
                GraderContext,
                get_rollout_context,
            )


            class Config(AgentWorkflowConfig):
                model: str = "osmosis-rollout"


            class Workflow(AgentWorkflow[Config]):
                async def run(self, ctx: AgentWorkflowContext[Config]) -> AgentWorkflowOutput:
                    rollout = get_rollout_context()
                    assert rollout is not None and rollout.chat_completions_url
                    config = ctx.config or Config(name="{name}")
                    messages: list[dict[str, Any]] = [dict(m) for m in ctx.prompt]
                    key = rollout.api_key
                    headers = {{"Authorization": f"Bearer {{key}}"}} if key else {{}}
                    url = rollout.chat_completions_url.rstrip("/") + "/chat/completions"
                    async with httpx.AsyncClient(timeout=60) as client:
                        body = {{"model": config.model, "messages": messages}}
                        answer = await client.post(url, json=body, headers=headers)
                        answer.raise_for_status()
                    content = answer.json()["choices"][0]["message"]["content"] or ""
                    messages.append({{"role": "assistant", "content": content}})
                    return AgentWorkflowOutput(messages=messages)


            class Answer(Grader):
                """1.0 when the last message is the label."""

                async def grade(self, ctx: GraderContext) -> None:
                    last = ctx.sample.messages[-1].get("content") if ctx.sample else None
                    ctx.set_reward(1.0 if str(last or "").strip() == (ctx.label or "") else 0.0)


            workflow_config = Config(name="{name}")
            ''',
    }


def _write(root: Path, files: dict[str, str]) -> None:
    if root.exists() and any(root.iterdir()):
        usage_error(f"{root} exists and is not empty: pick a new NAME (or --dir)")
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        if path.suffix == ".sh":
            path.chmod(0o755)


NameArgument = Annotated[str, typer.Argument(help="Its name: lowercase letters, digits, '-'.")]
DirOption = Annotated[
    Path | None, typer.Option("--dir", help="Where to write it (default: ./NAME).")
]


def _checked(name: str) -> str:
    if not _NAME.fullmatch(name):
        usage_error(f"NAME {name!r}: use lowercase letters, digits and '-', starting with a letter")
    return name


@init_app.command(cls=HelpCommand, name="task")
def init_task(name: NameArgument, directory: DirOption = None) -> None:
    """A minimal Harbor task (instruction, task.toml, Dockerfile, solve.sh, test.sh) that
    `harbor-exec validate` passes as it stands."""
    root = directory or Path(_checked(name))
    _write(root, TASK_FILES)
    console.print(f"wrote the task {root}/; check it with: harbor-exec validate {root}")


@init_app.command(cls=HelpCommand, name="project")
def init_project(name: NameArgument, directory: DirOption = None) -> None:
    """A workflow project in the osmosis-ai layout (workflow, grader and config in one
    module), ready to bundle and serve."""
    root = directory or Path(_checked(name))
    _write(root, _project_files(name))
    package = name.replace("-", "_")
    console.print(
        f"wrote the project {root}/ (src/{package}/main.py); bundle it with: harbor-exec "
        f"bundle {root} --workflow {package}.main:Workflow --grader {package}.main:Answer"
    )


__all__ = ["init_app"]
