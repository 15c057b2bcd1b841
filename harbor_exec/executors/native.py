"""Harbor's own agents (terminus-2, mini-swe-agent, opencode) as the agent of many
trials: the one place ``HarborBackend``'s rollouts and ``harbor-exec run``'s trials are
made from.

* ``native_agent_config``: what the user configured (the agent's name, its model
  route, its options, its setup timeout), checked once, before anything runs.
* ``model_endpoint``: one trial's upstream (the URL and the real key the relay
  holds) and the fresh token the agent uses as its key instead.
* ``native_agent_spec`` and ``native_secrets``: one trial's agent and secrets. The
  executor opens the rollout's relay in front of the endpoint (``LocalExecutor``),
  the agent dials it with the token, and the real key and the token are scrubbed
  from the trial's files.
"""

from __future__ import annotations

import importlib.util
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from harbor_exec.executors.spec import ModelEndpoint, NativeAgentSpec, TrialSecrets
from harbor_exec.sandbox.agent_layer import AgentLayer
from harbor_exec.trial.native import (
    DEFAULT_MODEL_NAME,
    NATIVE_AGENT_NAMES,
    check_model_name,
    check_native_kwargs,
    is_native_agent,
)


@dataclass(frozen=True)
class NativeAgentConfig:
    """One of Harbor's own agents (``harbor_exec.trial.native``) as the backend's agent."""

    name: str
    model_name: str = DEFAULT_MODEL_NAME
    kwargs: dict[str, Any] = field(default_factory=dict)
    setup_timeout_sec: float | None = None
    layer: AgentLayer | None = None  # an in-container agent's (mini-swe-agent, opencode)


def native_agent_config(
    agent: str,
    *,
    model_name: str = DEFAULT_MODEL_NAME,
    kwargs: Mapping[str, Any] | None = None,
    setup_timeout_sec: float | None = None,
) -> NativeAgentConfig:
    """``agent`` (one of ``NATIVE_AGENT_NAMES``) configured; ValueError saying what is
    wrong: an unknown name, Harbor missing, a model route other than ``openai/<id>``,
    options harbor-exec sets itself, a setup timeout that is not positive."""
    if not is_native_agent(agent):
        raise ValueError(
            f"unknown agent {agent!r}: Harbor's agents here are {', '.join(NATIVE_AGENT_NAMES)}"
        )
    if sys.version_info < (3, 12) or importlib.util.find_spec("harbor") is None:
        raise ValueError(
            f"agent {agent!r} needs Harbor (>= 0.26, Python >= 3.12): "
            "pip install 'harbor-exec[native]'"
        )
    if setup_timeout_sec is not None and setup_timeout_sec <= 0:
        raise ValueError("agent_setup_timeout_sec must be positive (or None)")
    return NativeAgentConfig(
        name=agent,
        model_name=check_model_name(model_name),
        kwargs=check_native_kwargs(kwargs or {}),
        setup_timeout_sec=setup_timeout_sec,
    )


def model_endpoint(
    url: str,
    api_key: str | None,
    extra_routes: tuple[str, ...] = (),
    *,
    field_name: str = "chat_completions_url",
) -> ModelEndpoint:
    """The upstream ``url`` (with the real ``api_key``, which only the relay holds) and
    a fresh per-trial token; ValueError naming ``field_name`` unless ``url`` is an
    absolute http(s) URL (the URL itself is not quoted: it may carry credentials)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{field_name} must be an absolute http(s) URL")
    return ModelEndpoint(
        url=url, api_key=api_key, token=secrets.token_urlsafe(32), extra_routes=extra_routes
    )


def native_agent_spec(
    config: NativeAgentConfig, instruction: str, model_name: str | None = None
) -> NativeAgentSpec:
    """The trial's agent: ``config``'s, on ``model_name`` when a rollout names another
    (already checked) route."""
    return NativeAgentSpec(
        name=config.name,
        model_name=model_name or config.model_name,
        instruction=instruction,
        kwargs=config.kwargs,
        setup_timeout_sec=config.setup_timeout_sec,
        layer=config.layer,
    )


def native_scrub(model: ModelEndpoint) -> list[str]:
    """What no file of the trial may hold: the real key, and the token (the agent
    writes its key into its own trajectory)."""
    return [value for value in (model.api_key, model.token) if value]


def native_secrets(model: ModelEndpoint) -> TrialSecrets:
    """A native agent's trial secrets (verified by the task's tests): ``model``, for
    the relay the executor opens in front of it, and what to scrub."""
    return TrialSecrets(model=model, scrub=native_scrub(model))


__all__ = [
    "NativeAgentConfig",
    "model_endpoint",
    "native_agent_config",
    "native_agent_spec",
    "native_scrub",
    "native_secrets",
]
