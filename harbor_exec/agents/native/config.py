"""What a native agent is configured with, checked once before anything runs.

The names harbor-exec runs (``NATIVE_AGENT_NAMES``; those inside the container,
``IN_CONTAINER_AGENT_NAMES``), the checks on a model route and the user's options, and
``NativeAgentConfig``: one of Harbor's agents as a backend's or ``harbor-exec run``'s
agent (its name, model route, options, setup timeout, and an in-container agent's
prepared layer).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the layer's module (and what it imports) is only for in-container agents
    from harbor_exec.agents.native.layer import AgentLayer

#: Harbor's agents harbor-exec runs (besides the oracle), by Harbor's names.
NATIVE_AGENT_NAMES: tuple[str, ...] = ("terminus-2", "mini-swe-agent", "opencode")
#: Those that run inside the trial's container (from their agent layer), not here.
IN_CONTAINER_AGENT_NAMES: tuple[str, ...] = ("mini-swe-agent", "opencode")
#: Every name ``agent=`` accepts besides a workflow reference (``module:attr``).
AGENT_NAMES: tuple[str, ...] = ("oracle", *NATIVE_AGENT_NAMES)
DEFAULT_MODEL_NAME = "openai/osmosis-rollout"
#: litellm picks the provider (and its ambient credentials) from the route's prefix:
#: only the OpenAI-compatible route, which honours ``api_base``, is accepted.
_MODEL_ROUTE = re.compile(r"openai/[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,255}")
#: Options harbor-exec sets itself: the model's route and key, and what makes the
#: sample (a user's value for them is refused at construction).
MANAGED_KWARGS = frozenset(
    {"api_base", "api_key", "model_name", "logs_dir", "extra_env", "session_id", "skip_install"}
)
#: Set for terminus-2, whatever the user's options say.
FORCED_KWARGS: Mapping[str, Any] = {"record_terminal_session": False, "store_all_messages": True}
#: Before litellm is imported (any import of Harbor's agents imports it): no cost-map
#: fetch from GitHub, no tokenizer download.
LITELLM_OFFLINE_ENV: Mapping[str, str] = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_OFFLINE_MODE": "true",
}


def is_native_agent(agent: object) -> bool:
    return isinstance(agent, str) and agent in NATIVE_AGENT_NAMES


def is_in_container_agent(agent: object) -> bool:
    return isinstance(agent, str) and agent in IN_CONTAINER_AGENT_NAMES


def check_agent_name(agent: object) -> None:
    """A string ``agent`` must be a known name or ``module:attr``; else ValueError
    listing the names."""
    if isinstance(agent, str) and ":" not in agent and agent not in AGENT_NAMES:
        raise ValueError(
            f"unknown agent {agent!r}: use one of {', '.join(AGENT_NAMES)}, or a workflow "
            "as 'module:attr'"
        )


def check_model_name(model: object, *, field_name: str = "model_name") -> str:
    """``model`` when it is an ``openai/<id>`` route; else ValueError naming ``field_name``."""
    if not isinstance(model, str) or _MODEL_ROUTE.fullmatch(model) is None:
        raise ValueError(
            f"{field_name} must be an 'openai/<id>' model route (the relay's "
            f"OpenAI-compatible endpoint); got {model!r}"
        )
    return model


def check_native_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The user's options for a native agent, refused when they set what harbor-exec
    manages (the model's route and key, the agent's environment)."""
    managed = sorted(set(kwargs) & MANAGED_KWARGS)
    if managed:
        raise ValueError(
            f"native_agent_kwargs may not set {', '.join(managed)}: harbor-exec sets the "
            "model's endpoint and key (the rollout's relay) itself"
        )
    llm_kwargs = kwargs.get("llm_kwargs")
    if llm_kwargs is not None:
        if not isinstance(llm_kwargs, Mapping):
            raise ValueError("native_agent_kwargs['llm_kwargs'] must be a mapping")
        bad = sorted(set(llm_kwargs) & {"api_key", "api_base", "base_url"})
        if bad:
            raise ValueError(f"native_agent_kwargs['llm_kwargs'] may not set {', '.join(bad)}")
    return dict(kwargs)


def set_litellm_offline() -> None:
    """Make litellm offline before it is first imported (idempotent)."""
    for key, value in LITELLM_OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class NativeAgentConfig:
    """One of Harbor's own agents (``harbor_exec.agents.native``) as the backend's agent."""

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


__all__ = [
    "AGENT_NAMES",
    "DEFAULT_MODEL_NAME",
    "FORCED_KWARGS",
    "IN_CONTAINER_AGENT_NAMES",
    "LITELLM_OFFLINE_ENV",
    "NATIVE_AGENT_NAMES",
    "NativeAgentConfig",
    "check_agent_name",
    "check_model_name",
    "check_native_kwargs",
    "is_in_container_agent",
    "is_native_agent",
    "native_agent_config",
    "set_litellm_offline",
]
