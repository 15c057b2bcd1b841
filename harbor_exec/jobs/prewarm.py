"""Prewarm a dataset: build every task image ahead of time, ``jobs`` at once.

With an in-container native agent's layer (``prepare_prewarm_agent``: its wheels
fetched once, the only network use), each task's prewarm also installs the layer's
volume (once per engine: it is content-named, the first task installs it).

With a package cache (``prewarm --package-cache``, docs/package-cache.md), each image
is built through it (``harbor_exec.network.packages.build_gateway``); with
``--run-verifier`` too, each task's oracle and verifier then run once through it, so
what ``solve.sh`` and ``test.sh`` fetch is cached before training starts (the trial is
thrown away; its reward is only reported).

A task that fails is reported with its reason and never stops the others. Each
task keeps only a small ``PrewarmOutcome`` (its build log went to a file while it
built), so memory stays flat over thousands of tasks. Identical environments share
a content-addressed tag; the runtime builds each tag once, whoever asks first.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from harbor_exec.agents.native.config import IN_CONTAINER_AGENT_NAMES, is_in_container_agent
from harbor_exec.agents.native.layer import AgentLayer, ensure_agent_layer
from harbor_exec.bundler.agent_wheels import prepare_agent_layer
from harbor_exec.network.egress.plan import EgressSettings
from harbor_exec.network.packages.build_route import build_cache
from harbor_exec.sandbox.runtime import ContainerRuntime
from harbor_exec.tasks.task import Task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest, ensure_task_image

if TYPE_CHECKING:
    from harbor_exec.network.packages.service import PackageCacheService

PrewarmStatus = Literal["built", "cached", "failed"]
STATUSES: tuple[PrewarmStatus, ...] = ("built", "cached", "failed")


@dataclass(frozen=True)
class PrewarmOutcome:
    """One task's prewarm: built now, already there, or failed (``detail`` says why)."""

    task: str
    status: PrewarmStatus
    seconds: float
    detail: str  # the image, or "<ErrorName>: <message>"

    @property
    def reason(self) -> str:
        """The first line of a failure (the whole message can hold a log tail)."""
        return self.detail.splitlines()[0] if self.detail else ""


@dataclass(frozen=True)
class PrewarmEvent:
    """``started`` when a task's build begins, ``finished`` with its outcome."""

    kind: Literal["started", "finished"]
    task: str
    outcome: PrewarmOutcome | None = None


def prepare_prewarm_agent(agent: str) -> AgentLayer:
    """The agent layer of ``agent`` (``mini-swe-agent``, ``opencode``), its wheels (and
    binaries) downloaded when this machine has none; ``ValueError`` for an agent
    without a layer."""
    if not is_in_container_agent(agent):
        raise ValueError(
            f"agent {agent!r} has no agent layer to prewarm: only "
            f"{', '.join(IN_CONTAINER_AGENT_NAMES)} (in-container agents) have one"
        )
    return prepare_agent_layer(agent)


def prewarm_one(
    runtime: ContainerRuntime,
    task: Task,
    agent_layer: AgentLayer | None = None,
    *,
    package_cache: PackageCacheService | None = None,
    egress: EgressSettings | None = None,
    run_verifier: bool = True,
) -> PrewarmOutcome:
    """Build (or find) one task's image (through ``package_cache`` when given), install
    ``agent_layer`` when given, and with ``package_cache`` and ``run_verifier`` run the
    task's oracle and verifier once through it; any error becomes a ``failed``
    outcome."""
    started = time.monotonic()
    try:
        image, built = ensure_task_image(runtime, task, build_cache(package_cache, egress))
        if agent_layer is not None:
            _volume, layer_built = ensure_agent_layer(runtime, agent_layer, image)
            built = built or layer_built
        if package_cache is not None and run_verifier:
            image = f"{image} ({_fill_cache(runtime, task, package_cache, egress)})"
    except Exception as exc:  # one broken task must never stop a dataset's prewarm
        return PrewarmOutcome(
            task.name, "failed", time.monotonic() - started, f"{type(exc).__name__}: {exc}"
        )
    return PrewarmOutcome(
        task.name, "built" if built else "cached", time.monotonic() - started, image
    )


def _fill_cache(
    runtime: ContainerRuntime,
    task: Task,
    cache: PackageCacheService,
    egress: EgressSettings | None,
) -> str:
    """One oracle trial through ``cache`` in a scratch dir; what it fetched, as text."""
    policy = SandboxPolicy(egress=egress) if egress is not None else SandboxPolicy()
    with tempfile.TemporaryDirectory(prefix="hx-prewarm-") as scratch:
        spec = TrialSpec(task=task, trials_dir=Path(scratch), policy=policy)
        result = run_trial(runtime, TrialRequest(spec, package_cache=cache))
        stats_file = Path(scratch) / result.trial_name / "package-cache.json"
        fetched = stats_file.read_text() if stats_file.exists() else ""
    misses = int(json.loads(fetched).get("misses", 0)) if fetched else 0
    return f"verifier ran, reward {result.reward}, {misses} downloads cached"


def prewarm_tasks(
    runtime: ContainerRuntime,
    tasks: Sequence[Task],
    *,
    jobs: int,
    on_event: Callable[[PrewarmEvent], None] | None = None,
    agent_layer: AgentLayer | None = None,
    package_cache: PackageCacheService | None = None,
    run_verifier: bool = False,
    egress: EgressSettings | None = None,
) -> list[PrewarmOutcome]:
    """Prewarm ``tasks`` with up to ``jobs`` builds at once (and ``agent_layer``'s
    volume with them), through ``package_cache`` when given (``run_verifier``: each
    task's verifier too); outcomes in ``tasks`` order."""
    emit = on_event or (lambda event: None)
    emit_lock = threading.Lock()  # display callbacks need not be thread-safe

    def one(task: Task) -> PrewarmOutcome:
        with emit_lock:
            emit(PrewarmEvent("started", task.name))
        outcome = prewarm_one(
            runtime,
            task,
            agent_layer,
            package_cache=package_cache,
            egress=egress,
            run_verifier=run_verifier,
        )
        with emit_lock:
            emit(PrewarmEvent("finished", task.name, outcome))
        return outcome

    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="hx-prewarm") as pool:
        return list(pool.map(one, tasks))


def tally(outcomes: Sequence[PrewarmOutcome], *, extra_failed: int = 0) -> dict[str, int]:
    """``{built, cached, failed}`` counts."""
    counts: dict[str, int] = {status: 0 for status in STATUSES}
    for outcome in outcomes:
        counts[outcome.status] += 1
    counts["failed"] += extra_failed
    return counts
