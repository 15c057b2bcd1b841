"""Harbor's own agents (terminus-2, mini-swe-agent, opencode) as trial agents, run unchanged.

``NativeAgent`` is the trial-side ``Agent``: plain values only (the agent's name,
model route, options, the rollout's relay token and socket). Its ``run`` imports
Harbor (the ``native`` extra, Python >= 3.12) only then, through
``harbor_exec.trial.native_env``, which implements Harbor's ``BaseEnvironment`` over
the trial's ``TrialSession`` and drives the agent's ``setup`` and ``run`` there.

terminus-2 runs in the host process and reaches the model only through the
rollout's relay, over a loopback listener (``127.0.0.1``) piped onto the relay's
unix socket, with the per-rollout token as its key: the trainer's key never reaches
it, the container needs no network, and nothing the agent writes holds the key.
Inside the container terminus-2 needs only tmux, which comes from the read-only
runtime (``RUNTIME_TMUX``), never from the image or an install.

mini-swe-agent and opencode run inside the container, from their prebuilt read-only
layer (``harbor_exec.sandbox.agent_layer``; Harbor's install step never runs), and reach
the model through the runtime's in-container forwarder (``runner forward``, a
loopback port piped onto the relay's socket mounted into the container), with the
per-rollout token as its key: every command the model runs can read that token,
never the trainer's key.

The sample is the exact chat terminus-2 held (``store_all_messages``), with the
token ids and logprobs of ``rollout_details`` when the upstream returned them. For
an in-container agent, whose own files the model's commands can rewrite, it is the
last chat call as the relay saw it (its messages, then the answer).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.trial.agents import AgentRun, TrialSession
from harbor_exec.trial.results import AgentInfo, ModelInfo
from harbor_exec.trial.task import Task

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


@dataclass(frozen=True, kw_only=True)
class NativeAgent:
    """Harbor's agent ``name`` (terminus-2) over the trial's container (see module doc).

    ``relay_socket`` is the host path of the rollout's relay socket and
    ``relay_path`` the chat URL's path (``/v1``): the agent's ``api_base`` is a
    loopback listener piped onto that socket, its key ``token``.
    """

    name: str
    model_name: str
    instruction: str = field(repr=False)
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    setup_timeout_sec: float | None = None
    token: str = field(repr=False)
    relay_socket: str | None = None
    relay_path: str = "/v1"
    #: In-container agents: the relay's record of the rollout's last chat call
    #: (``ModelRelay.last_chat``), read once the agent is done.
    relay_chat: Callable[[], Mapping[str, Any] | None] | None = field(
        default=None, compare=False, repr=False
    )
    #: Set by ``cancel()`` (the trial's ``cancel``, from any thread): the agent's loop
    #: runs on this trial's thread, in its own event loop, and stops at once.
    cancelled: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def in_container(self) -> bool:
        return is_in_container_agent(self.name)

    @property
    def info(self) -> AgentInfo:
        provider, _, model = self.model_name.partition("/")
        return AgentInfo(
            name=self.name,
            version=_harbor_version(),
            model_info=ModelInfo(name=model, provider=provider),
        )

    def files(self, task: Task) -> list[ArchiveEntry]:
        return []

    def run(self, session: TrialSession, timeout_sec: float | None) -> AgentRun:
        set_litellm_offline()
        from harbor_exec.trial.native_env import run_native_agent  # the native extra

        return run_native_agent(self, session, timeout_sec)


def _harbor_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"harbor-{version('harbor')}"
    except PackageNotFoundError:
        return "unknown"


__all__ = [
    "AGENT_NAMES",
    "DEFAULT_MODEL_NAME",
    "FORCED_KWARGS",
    "IN_CONTAINER_AGENT_NAMES",
    "LITELLM_OFFLINE_ENV",
    "NATIVE_AGENT_NAMES",
    "NativeAgent",
    "check_agent_name",
    "check_model_name",
    "check_native_kwargs",
    "is_in_container_agent",
    "is_native_agent",
    "set_litellm_offline",
]
