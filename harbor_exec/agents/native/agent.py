"""Harbor's own agents (terminus-2, mini-swe-agent, opencode) as trial agents, run unchanged.

``NativeAgent`` is the trial-side ``Agent``: plain values only (the agent's name,
model route, options, the rollout's relay token and socket). Its ``run`` imports
Harbor (the ``native`` extra, Python >= 3.12) only then, through
``harbor_exec.agents.native.environment``, which implements Harbor's
``BaseEnvironment`` over the trial's session (``AgentSession``) and drives the agent's
``setup`` and ``run`` there.

terminus-2 runs in the host process and reaches the model only through the
rollout's relay, over a loopback listener (``127.0.0.1``) piped onto the relay's
unix socket, with the per-rollout token as its key: the trainer's key never reaches
it, the container needs no network, and nothing the agent writes holds the key.
Inside the container terminus-2 needs only tmux, which comes from the read-only
runtime (``RUNTIME_TMUX``), never from the image or an install.

mini-swe-agent and opencode run inside the container, from their prebuilt read-only
layer (``harbor_exec.agents.native.layer``; Harbor's install step never runs), and reach
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

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from harbor_exec.agents.base import (
    AgentInfo,
    AgentInputs,
    AgentRun,
    AgentSession,
    ModelInfo,
    RelayUse,
)
from harbor_exec.agents.native.config import (
    NativeAgentConfig,
    is_in_container_agent,
    set_litellm_offline,
)
from harbor_exec.agents.native.layer import AgentLayer
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.tasks.task import Task


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

    def run(self, session: AgentSession, timeout_sec: float | None) -> AgentRun:
        set_litellm_offline()
        from harbor_exec.agents.native.environment import run_native_agent  # the native extra

        return run_native_agent(self, session, timeout_sec)


def _harbor_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"harbor-{version('harbor')}"
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class NativeAgentSpec:
    """One of Harbor's own agents, run unchanged: its name, model route and options
    (plain JSON values), its setup timeout and the instruction. The relay token it
    uses as its key is ``TrialSecrets.model.token``."""

    name: str
    model_name: str
    instruction: str = field(repr=False)
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    setup_timeout_sec: float | None = None
    #: An in-container agent's prebuilt layer (``harbor_exec.agents.native.layer``).
    #: None for one makes its setup fail, naming what is missing (nothing is fetched
    #: at trial time); prepared at prewarm or the backend's start.
    prepared_layer: AgentLayer | None = None

    @property
    def info(self) -> AgentInfo:
        return self.agent(AgentInputs(model_token="")).info

    @property
    def in_container(self) -> bool:
        """mini-swe-agent, opencode: run in the container, from their agent layer, via the
        relay mount."""
        return is_in_container_agent(self.name)

    @property
    def relay(self) -> RelayUse:
        # terminus-2 dials the relay's socket from this process; mini-swe-agent and
        # opencode reach it from the container, and their sample is the chat the relay
        # saw (what the container writes is the agent's to rewrite).
        if self.in_container:
            return RelayUse(mount=True, socket_path=True, record_chat=True)
        return RelayUse(mount=False, socket_path=True)

    @property
    def layer(self) -> AgentLayer | None:
        return self.prepared_layer if self.in_container else None

    def agent(self, inputs: AgentInputs) -> NativeAgent:
        if inputs.model_token is None:
            raise ValueError("a native agent's trial needs its model endpoint (TrialSecrets.model)")
        return NativeAgent(
            name=self.name,
            model_name=self.model_name,
            instruction=self.instruction,
            kwargs=self.kwargs,
            setup_timeout_sec=self.setup_timeout_sec,
            token=inputs.model_token,
            relay_socket=inputs.relay_socket,
            relay_path=inputs.relay_path,
            relay_chat=inputs.relay_chat,
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
        prepared_layer=config.layer,
    )


__all__ = ["NativeAgent", "NativeAgentSpec", "native_agent_spec"]
