"""``harbor-exec run``: a whole dataset with one of Harbor's own agents (terminus-2)
and a model endpoint, written as Harbor writes a job (``validate`` is the oracle's).

Every trial gets its own model relay in front of ``--api-base``: the relay holds the
real key (read from the environment variable ``--api-key-env`` names, never from the
command line, never written anywhere), the agent dials it with a per-trial token,
and what the relay counted is the trial's ``agent_result``.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from harbor_exec.agents.native.agent import native_agent_spec
from harbor_exec.agents.native.config import (
    NATIVE_AGENT_NAMES,
    NativeAgentConfig,
    check_model_name,
    check_native_kwargs,
    is_in_container_agent,
    is_native_agent,
    native_agent_config,
    set_litellm_offline,
)
from harbor_exec.agents.native.layer import AgentLayer, AgentLayerError
from harbor_exec.backends.harbor.config import SandboxConfig
from harbor_exec.cli.helpers import (
    console,
    filter_tasks,
    open_runtime,
    parse_agent_kwargs,
    run_dataset_job,
    select_dataset,
)
from harbor_exec.cli.options import (
    AGENT,
    DEFAULT_JOBS_DIR,
    DEFAULT_N_CONCURRENT,
    AgentKwargOption,
    AllowUnpinnedOption,
    DatasetRefOption,
    ExcludeTaskOption,
    IncludeTaskOption,
    JobNameOption,
    JobsDirOption,
    MaxRetriesOption,
    NAttemptsOption,
    NConcurrentOption,
    NTasksOption,
    PackageSourceOption,
    RegistryPathOption,
    RegistryUrlOption,
    RunAgentOption,
    RunAgentSetupTimeoutOption,
    RunModelNameOption,
    TaskRefOption,
    TasksPathArgument,
    takes_package_cache,
    takes_sandbox,
)
from harbor_exec.executors.spec import TrialSecrets, model_endpoint, native_secrets
from harbor_exec.jobs.dataset import JobOutcome
from harbor_exec.network.packages.config import PackageCacheConfig
from harbor_exec.tasks.task import Task
from harbor_exec.trial.spec import TrialSpec

__all__ = ["RunAgent", "check_run_agent", "run"]

_SANDBOX = SandboxConfig()

#: A shell variable's name: what ``--api-key-env`` takes (a key never is one).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class RunAgent:
    """What ``run`` was asked to run with, checked (see ``check_run_agent``)."""

    def __init__(
        self, config: NativeAgentConfig, api_base: str, api_key: str | None, key_env: str | None
    ) -> None:
        self.config = config
        self.api_base = api_base
        self._api_key = api_key  # only ever handed to the trials' relays
        self.key_env = key_env

    def __repr__(self) -> str:
        return f"RunAgent({self.config.name!r}, {self.config.model_name!r})"

    @property
    def harbor_config(self) -> dict[str, Any]:
        """Harbor's ``AgentConfig`` fields (job and trial ``config.json``; what a resume
        must match): the name of the key's variable, never the key, nor the URL (it
        may carry credentials)."""
        config: dict[str, Any] = {
            "name": self.config.name,
            "model_name": self.config.model_name,
            "kwargs": self.config.kwargs,
        }
        if self.key_env is not None:
            config["model_api_key_name"] = self.key_env
        if self.config.setup_timeout_sec is not None:
            config["override_setup_timeout_sec"] = self.config.setup_timeout_sec
        return config

    def spec(self, task: Task, job_dir: Path, **spec_args: Any) -> TrialSpec:
        return TrialSpec(
            task, job_dir, agent=native_agent_spec(self.config, task.instruction), **spec_args
        )

    def secrets(self, _spec: TrialSpec) -> TrialSecrets:
        """A fresh endpoint per trial: its own relay token, the key for its relay."""
        return native_secrets(model_endpoint(self.api_base, self._api_key, field_name="--api-base"))


def check_run_agent(
    agent: str,
    *,
    model_name: str,
    api_base: str,
    api_key_env: str | None,
    agent_kwargs: list[str],
    agent_setup_timeout_sec: float | None,
    environ: Mapping[str, str] = os.environ,
) -> RunAgent:
    """``run``'s agent options, checked before anything starts; ``typer.BadParameter``
    naming the flag otherwise."""
    if not is_native_agent(agent):
        hint = " (the oracle is `harbor-exec validate`)" if agent == "oracle" else ""
        raise typer.BadParameter(
            f"unknown agent {agent!r}: use one of Harbor's agents "
            f"{', '.join(NATIVE_AGENT_NAMES)}{hint}",
            param_hint="--agent",
        )
    try:
        check_model_name(model_name, field_name="--model-name")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model-name") from None
    kwargs = parse_agent_kwargs(agent_kwargs)
    try:
        check_native_kwargs(kwargs)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--agent-kwarg") from None
    try:
        model_endpoint(api_base, None, field_name="--api-base")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--api-base") from None
    api_key = None
    if api_key_env is not None:
        if _ENV_NAME.fullmatch(api_key_env) is None:
            # Not echoed: it may be the key itself, given by mistake.
            raise typer.BadParameter(
                "takes the NAME of an environment variable that holds the key (e.g. "
                "OPENAI_API_KEY), never the key itself",
                param_hint="--api-key-env",
            )
        api_key = environ.get(api_key_env) or None
        if api_key is None:
            raise typer.BadParameter(
                f"the environment variable {api_key_env} is not set or empty: export the "
                "model's key there",
                param_hint="--api-key-env",
            )
    try:
        config = native_agent_config(
            agent, model_name=model_name, kwargs=kwargs, setup_timeout_sec=agent_setup_timeout_sec
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--agent") from None
    return RunAgent(config, api_base, api_key, api_key_env)


@takes_sandbox()
@takes_package_cache
def run(
    agent: RunAgentOption,
    model_name: RunModelNameOption,
    api_base: Annotated[
        str,
        typer.Option(
            "--api-base",
            rich_help_panel=AGENT,
            help="The model's OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1); "
            "each trial reaches it only through its own relay.",
        ),
    ],
    api_key_env: Annotated[
        str | None,
        typer.Option(
            "--api-key-env",
            metavar="VAR",
            rich_help_panel=AGENT,
            help="The environment variable holding the model's key (never the key itself; "
            "without it, calls carry no key).",
        ),
    ] = None,
    agent_kwarg: AgentKwargOption = None,
    agent_setup_timeout_sec: RunAgentSetupTimeoutOption = None,
    path: TasksPathArgument = None,
    dataset: DatasetRefOption = None,
    task: TaskRefOption = None,
    package_source: PackageSourceOption = None,
    include_task_name: IncludeTaskOption = None,
    exclude_task_name: ExcludeTaskOption = None,
    n_tasks: NTasksOption = None,
    registry_path: RegistryPathOption = None,
    registry_url: RegistryUrlOption = None,
    task_git_allow_unpinned: AllowUnpinnedOption = False,
    n_concurrent: NConcurrentOption = DEFAULT_N_CONCURRENT,
    n_attempts: NAttemptsOption = 1,
    max_retries: MaxRetriesOption = 0,
    jobs_dir: JobsDirOption = DEFAULT_JOBS_DIR,
    job_name: JobNameOption = None,
    sandbox: SandboxConfig = _SANDBOX,
    package_cache: PackageCacheConfig | None = None,
) -> None:
    """Run Harbor's agent with a model on every task, as Harbor's job layout (pass@k,
    mean reward, tokens); exit 0 once every trial ran, whatever the rewards."""
    chosen = check_run_agent(
        agent,
        model_name=model_name,
        api_base=api_base,
        api_key_env=api_key_env,
        agent_kwargs=list(agent_kwarg or []),
        agent_setup_timeout_sec=agent_setup_timeout_sec,
    )
    if is_in_container_agent(agent):
        chosen.config = replace(chosen.config, layer=_agent_layer(agent))
    selected = select_dataset(
        path,
        dataset,
        registry_path,
        registry_url,
        task_git_allow_unpinned,
        task=task,
        package_source=package_source,
    )
    selected = filter_tasks(selected, include_task_name, exclude_task_name, n_tasks)
    # Harbor's import (litellm's, mostly) takes seconds: once, now, and offline.
    set_litellm_offline()
    importlib.import_module("harbor_exec.agents.native.environment")
    runtime = open_runtime()
    from harbor_exec.executors.local import LocalExecutor  # the server extra (the relay)

    policy = sandbox.policy(max_concurrent_trials=n_concurrent, pid_max=runtime.pid_max)
    outcome = run_dataset_job(
        "run",
        selected,
        runtime,
        jobs_dir=jobs_dir,
        job_name=job_name,
        n_concurrent=n_concurrent,
        n_attempts=n_attempts,
        package_cache=package_cache,
        max_retries=max_retries,
        make_spec=lambda task, job_dir: chosen.spec(task, job_dir, policy=policy),
        # Each trial's relay (and the native agent) run in this process.
        executor=LocalExecutor(runtime),
        agent=chosen.harbor_config,
        make_secrets=chosen.secrets,
    )
    _print_scores(outcome)
    raise typer.Exit(0)


def _agent_layer(agent: str) -> AgentLayer:
    """An in-container agent's layer (fetched now when this machine has none: the only
    time the network is used); exit 2 saying why when it cannot be had."""
    from harbor_exec.bundler.errors import BundleError
    from harbor_exec.jobs.prewarm import prepare_prewarm_agent

    try:
        return prepare_prewarm_agent(agent)
    except (AgentLayerError, BundleError, OSError) as exc:
        console.print(
            f"[red]{escape(agent)}'s agent layer is not available:[/red] {escape(str(exc))}"
        )
        raise typer.Exit(2) from None


def _print_scores(outcome: JobOutcome) -> None:
    stats = outcome.job_result.stats
    for key, evals in stats.evals.items():
        means = ", ".join(f"{k} {v:.3f}" for m in evals.metrics for k, v in m.items()) or "-"
        passes = ", ".join(f"pass@{k} {v:.3f}" for k, v in evals.pass_at_k.items())
        console.print(
            f"{escape(key)}: {evals.n_trials} trial(s) with a reward, {evals.n_errors} "
            f"error(s); {means}" + (f"; {passes}" if passes else "")
        )
    tokens = [
        f"{what} {value}"
        for what, value in (
            ("input", stats.n_input_tokens),
            ("cached", stats.n_cache_tokens),
            ("output", stats.n_output_tokens),
        )
        if value is not None
    ]
    cost = f"; cost ${stats.cost_usd:.4f}" if stats.cost_usd is not None else ""
    if tokens:
        console.print("tokens (the relays' counts): " + ", ".join(tokens) + cost)
