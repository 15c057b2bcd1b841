"""What a trial is, apart from where it runs (as uvicorn's ``Config`` is apart from its ``Server``).

* ``TrialSpec`` (``harbor_exec.trial.spec``): plain, picklable, no secret. The task
  (its snapshot travels by ``task_key``), the agent and the verifier as plain data,
  the workflow bundle and its dependency layer by content key, the sandbox policy.
* ``TrialSecrets``: everything per-rollout that may hold a secret (the model
  endpoint with the trainer's key, the values to scrub, the agent's and the
  verifier's ``rollout.json``). The Ray driver seals it for one node.
* ``TrialContent``: one machine's copies of what a spec names by key (the task
  snapshot, the wheelhouse, the bundle's two parts: the agent's files and the
  grader's, which only the verifier side gets).

``trial_request`` turns the three into the runnable ``TrialRequest`` (which holds the
spec, with this machine's copies in it); the local executor and the Ray node both
build their trials through it.
"""

from __future__ import annotations

import secrets as secrets_module
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from harbor_exec.agents.base import AgentInputs
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.sandbox.runtime import Mount
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest, WaitTurn
from harbor_exec.trial.verifiers import TestsVerifier, grader_verifier, tests_verifier
from harbor_exec.trial.warm import WarmPool

if TYPE_CHECKING:
    from harbor_exec.network.packages.service import PackageCacheService


@dataclass(frozen=True)
class ModelEndpoint:
    """The trainer's chat endpoint for one rollout, and the token its workflow uses."""

    url: str
    api_key: str | None = field(repr=False)
    token: str = field(repr=False)
    # POST routes under the URL's path the relay forwards besides /chat/completions
    # (RelayLimits.extra_routes); here so they travel with the trial to its node.
    extra_routes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrialSecrets:
    """The part of a trial that may hold a secret; never logged, stored or shown."""

    model: ModelEndpoint | None = None  # the relay's upstream, for workflows
    scrub: Sequence[str] = field(default=(), repr=False)  # removed from the trial dir
    agent_input: bytes | None = field(default=None, repr=False)  # a workflow's rollout.json
    verifier_input: bytes | None = field(default=None, repr=False)  # the grader's, with the label
    #: Variables only the bundled grader's process gets (a judge's key), in its own
    #: verifier container: never in the bundle, the agent's container or a file.
    grader_env: Mapping[str, str] = field(default_factory=dict, repr=False)


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
        url=url,
        api_key=api_key,
        token=secrets_module.token_urlsafe(32),
        extra_routes=extra_routes,
    )


def native_scrub(model: ModelEndpoint) -> list[str]:
    """What no file of a native agent's trial may hold: the real key, and the token
    (the agent writes its key into its own trajectory)."""
    return [value for value in (model.api_key, model.token) if value]


def native_secrets(model: ModelEndpoint) -> TrialSecrets:
    """A native agent's trial secrets (verified by the task's tests): ``model``, for
    the relay the executor opens in front of it, and what to scrub."""
    return TrialSecrets(model=model, scrub=native_scrub(model))


@dataclass(frozen=True)
class TrialContent:
    """This machine's copies of what a spec names by key, and where it writes trial
    directories (None: the spec's own paths; no bundle)."""

    task_root: Path | None = None
    wheelhouse: Path | None = None
    # ``spec.bundle``: the agent's part, placed in the agent's container.
    bundle_files: Sequence[ArchiveEntry] = field(default=(), repr=False)
    trials_dir: Path | None = None
    # ``spec.grader_bundle``: the grader's part, placed only under GRADER_DIR by the verifier.
    grader_files: Sequence[ArchiveEntry] = field(default=(), repr=False)


def trial_request(
    spec: TrialSpec,
    secrets: TrialSecrets | None = None,
    content: TrialContent | None = None,
    *,
    mounts: Sequence[Mount] = (),
    relay_socket: str | None = None,
    relay_chat: Callable[[], Mapping[str, Any] | None] | None = None,
    package_cache: PackageCacheService | None = None,
    warm_pool: WarmPool | None = None,
    wait_turn: WaitTurn | None = None,
) -> TrialRequest:
    """The runnable trial of ``spec`` on this machine: its agent (made by the spec's
    agent kind, ``AgentSpec.agent``) and verifier built from ``secrets`` and
    ``content``, with ``mounts`` in the agent's container (e.g. the model relay) and
    the kind's prepared layer; ``relay_socket``: the host path of the rollout's relay
    socket, and ``relay_chat``: the relay's record of the last chat call, each for an
    agent whose ``AgentSpec.relay`` asks for it; ``package_cache``: this machine's live
    cache, and ``warm_pool`` its warm containers, which the request carries beside the
    spec, as ``wait_turn`` (``TrialRequest.wait_turn``)."""
    secrets = secrets or TrialSecrets()
    content = content or TrialContent()
    task = spec.task
    if content.task_root is not None:
        task = replace(task, files=content.task_root)
    deps = spec.deps
    if deps is not None and content.wheelhouse is not None:
        deps = replace(deps, wheelhouse=content.wheelhouse)
    model = secrets.model
    agent = spec.agent.agent(
        AgentInputs(
            model_token=None if model is None else model.token,
            relay_path=urlsplit(model.url).path.rstrip("/") if model is not None else "/v1",
            relay_socket=relay_socket,
            relay_chat=relay_chat,
            rollout_input=secrets.agent_input,
            bundle_files=content.bundle_files,
        )
    )
    verifier: TestsVerifier | None = None
    if spec.verifier == "grader":
        if secrets.verifier_input is None:
            raise ValueError("a bundled grader needs its input (TrialSecrets.verifier_input)")
        if not content.grader_files:
            raise ValueError("a bundled grader needs the bundle's grader part (grader_files)")
        verifier = grader_verifier(
            secrets.verifier_input, content.grader_files, env=secrets.grader_env
        )
    elif secrets.verifier_input is not None:
        verifier = tests_verifier(task.tests_dir, secrets.verifier_input)
    # This machine's copies of what the spec names by key.
    local = replace(spec, task=task, trials_dir=content.trials_dir or spec.trials_dir, deps=deps)
    return TrialRequest(
        local,
        agent=agent,
        verifier=verifier,
        secrets=list(secrets.scrub),
        mounts=mounts,
        package_cache=package_cache,
        warm_pool=warm_pool,
        wait_turn=wait_turn,
    )


__all__ = [
    "ModelEndpoint",
    "TrialContent",
    "TrialSecrets",
    "model_endpoint",
    "native_scrub",
    "native_secrets",
    "trial_request",
]
