"""The live console's figures (``GET /console/data``), kept as rollouts finish.

``ConsoleStats.finished`` runs once per rollout on the event loop and only adds to
bounded running aggregates, so a page's data costs the same whatever the store holds:

* counts by status since the server started, and the last ``RECENT`` results;
* failures grouped by category and reason (digits and hex runs folded, so one cause with
  many ids is one group), each with its origin (agent, infrastructure, client);
* per phase the last ``WINDOW`` durations, overall and per node, for p50/p95/p99: the
  server's ``queued`` and ``running``, the backend's timings (HarborBackend:
  ``environment_setup``, ``agent_setup``, ``agent``, ``verifier``, ``teardown``,
  ``total``);
* per task: rollouts, successes, failures, rewards (mean, pass rate: a reward of at least
  1) and its last ``TASK_HISTORY`` rewards; a task with at least ``FLAG_MIN`` finished
  rollouts is flagged ``always_fails`` (none scored above 0) or ``always_passes`` (all
  scored at least 1);
* per group (``metadata.group_id``, else ``metadata.group``: the rollouts a GRPO step
  sends together) its rewards; a group of two or more whose rewards are all equal teaches
  nothing, and is listed.

The running rollouts (task, status, age) come from the registry when asked; the package
cache's figures from its metrics; the nodes from the backend's ``queue_info``.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import re
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from harbor_exec.protocol import RolloutStatus, group_of
from harbor_exec.server.metrics import FAILURE_ORIGIN
from harbor_exec.server.registry import RolloutEntry
from harbor_exec.server.store import RolloutRecord

__all__ = [
    "CONSOLE_FILES",
    "CONSOLE_HEADERS",
    "DOCS_HEADERS",
    "PUBLIC_FILES",
    "REDOC_HEADERS",
    "ConsoleStats",
    "console_asset",
]

RECENT: Final = 50
WINDOW: Final = 2048
TASK_HISTORY: Final = 30
FLAG_MIN: Final = 3
MAX_TASKS: Final = 10_000
MAX_GROUPS: Final = 10_000
MAX_FAILURE_GROUPS: Final = 500
MAX_NODES: Final = 256
_FOLD = re.compile(r"0x[0-9a-fA-F]+|[0-9a-fA-F]{8,}|\d+")

#: Finished rollouts a restarted server reads back into the console, at most.
SEED_ROWS: Final = 20_000

#: The files served under ``/console/`` (``server/assets/``), by path: the page's own
#: besides ``index.html``, Swagger UI's for ``/docs`` and ReDoc's for ``/redoc`` (both
#: vendored, see their README.txt).
CONSOLE_FILES: Final = {
    "console.js": "text/javascript",
    "console.css": "text/css",
    "favicon.svg": "image/svg+xml",
    "swagger-ui/swagger-ui-bundle.js": "text/javascript",
    "swagger-ui/swagger-ui.css": "text/css",
    "redoc/redoc.standalone.js": "text/javascript",
}
#: With an API key, the paths served without it: the console's own code and style, the
#: same bytes as the wheel's (they hold nothing of the server), so that the page can ask
#: for the key; ``GET /`` without the key answers 401 with the page's empty shell.
PUBLIC_FILES: Final = frozenset(
    f"/console/{name}" for name in ("console.js", "console.css", "favicon.svg")
)
#: ``/docs``: Swagger UI's page starts it with an inline script.
DOCS_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'",
}
#: ``/redoc``: ReDoc styles itself inline and runs its search in a worker made from a blob.
REDOC_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; "
    "frame-ancestors 'none'",
}
#: The page loads nothing from anywhere but this server.
CONSOLE_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@functools.cache
def console_asset(name: str) -> bytes:
    """A file of the console, read once from the package."""
    resource = importlib.resources.files("harbor_exec.server") / "assets"
    for part in name.split("/"):
        resource = resource / part
    return resource.read_bytes()


@dataclass
class _Task:
    rollouts: int = 0
    success: int = 0
    failure: int = 0
    cancelled: int = 0
    rewarded: int = 0
    reward_sum: float = 0.0
    passed: int = 0
    positive: int = 0
    recent: deque[float | None] = field(default_factory=lambda: deque(maxlen=TASK_HISTORY))


@dataclass
class _Group:
    rollouts: int = 0
    task: str | None = None
    reward: float | None = None  # the first reward
    equal: bool = True  # every rollout so far rewarded, all with ``reward``


@dataclass
class _Failure:
    category: str
    origin: str
    reason: str
    count: int = 0
    last_rollout_id: str = ""
    last_at: float = 0.0


class ConsoleStats:
    """Running aggregates of finished rollouts (see the module doc)."""

    def __init__(self) -> None:
        self.started_at = time.time()
        self.counts: dict[str, int] = {"success": 0, "failure": 0, "cancelled": 0}
        # (rollout_id, task, status, reward, seconds, err_category, reason, node, at)
        self.recent: deque[tuple[Any, ...]] = deque(maxlen=RECENT)
        self.failures: OrderedDict[tuple[str, str], _Failure] = OrderedDict()
        self.phases: dict[str, deque[float]] = {}
        self.node_phases: dict[str, dict[str, deque[float]]] = {}
        self.tasks: OrderedDict[str, _Task] = OrderedDict()
        self.groups: OrderedDict[str, _Group] = OrderedDict()
        # The groups of two or more whose rewards all agree so far, latest last.
        self.equal_groups: OrderedDict[str, _Group] = OrderedDict()

    # ------------------------------------------------------------------ updates

    def finished(
        self,
        entry: RolloutEntry,
        *,
        status: str,
        reward: float | None,
        err_category: str | None,
        reason: str | None,
        info: Mapping[str, Any] | None,
    ) -> None:
        """One finished rollout (the service calls this once per rollout)."""
        self.add(
            entry.rollout_id,
            task=entry.task_name,
            group=group_of(entry.metadata) if entry.metadata else None,
            admitted=entry.wall_admitted,
            running=entry.wall_running,
            finished=entry.wall_finished or time.time(),
            status=status,
            reward=reward,
            err_category=err_category,
            reason=reason,
            info=info,
        )

    def seed(self, records: Iterable[tuple[RolloutRecord, str | None]]) -> None:
        """Rollouts a previous server finished (oldest first, each with its group), so
        that a restarted console does not start empty."""
        for record, group in records:
            if record.finished_at is None:
                continue
            info = record.detail if isinstance(record.detail, Mapping) else None
            reason = info.get("reason") if info else None
            self.add(
                record.rollout_id,
                task=record.task,
                group=group,
                admitted=record.admitted_at,
                running=record.running_at,
                finished=record.finished_at,
                status=record.status,
                reward=record.reward,
                err_category=record.err_category,
                reason=reason if reason is not None else record.err_message,
                info=info,
            )

    def add(
        self,
        rollout_id: str,
        *,
        task: str | None,
        group: str | None,
        admitted: float,
        running: float | None,
        finished: float,
        status: str,
        reward: float | None,
        err_category: str | None,
        reason: str | None,
        info: Mapping[str, Any] | None,
    ) -> None:
        """One finished rollout, from its parts."""
        self.counts[status] = self.counts.get(status, 0) + 1
        if reward is not None and not math.isfinite(reward):
            reward = None
        node = info.get("node") if info else None
        self.recent.append(
            (rollout_id, task, status, reward, finished - admitted, err_category, reason, node,
             finished)
        )  # fmt: skip
        if status == "failure":
            self._failure(rollout_id, err_category or "internal_error", reason or "", finished)
        self._phases(admitted, running, finished, info, node)
        if task is not None:
            self._task(task, status, reward)
        if group is not None and status != "cancelled":
            self._group(group, task, reward)

    def _failure(self, rollout_id: str, category: str, reason: str, now: float) -> None:
        folded = _FOLD.sub("#", " ".join(reason.split()))[:160]
        key = (category, folded)
        failure = self.failures.get(key)
        if failure is None:
            if len(self.failures) >= MAX_FAILURE_GROUPS:
                self.failures.popitem(last=False)
            failure = self.failures[key] = _Failure(
                category, FAILURE_ORIGIN.get(category, "infrastructure"), folded
            )
        else:
            self.failures.move_to_end(key)
        failure.count += 1
        failure.last_rollout_id = rollout_id
        failure.last_at = now

    def _phases(
        self,
        admitted: float,
        running: float | None,
        now: float,
        info: Mapping[str, Any] | None,
        node: Any,
    ) -> None:
        observed: list[tuple[str, float]] = []
        if running is not None:
            observed.append(("queued", running - admitted))
            observed.append(("running", now - running))
        timings = info.get("timings_sec") if info else None
        if isinstance(timings, Mapping):
            observed.extend(
                (str(name), float(seconds))
                for name, seconds in timings.items()
                if isinstance(seconds, int | float) and math.isfinite(seconds)
            )
        if not observed:
            return
        per_node = None
        if isinstance(node, str):
            per_node = self.node_phases.get(node)
            if per_node is None and len(self.node_phases) < MAX_NODES:
                per_node = self.node_phases[node] = {}
        for name, seconds in observed:
            window = self.phases.get(name)
            if window is None:
                window = self.phases[name] = deque(maxlen=WINDOW)
            window.append(seconds)
            if per_node is not None:
                node_window = per_node.get(name)
                if node_window is None:
                    node_window = per_node[name] = deque(maxlen=WINDOW)
                node_window.append(seconds)

    def _task(self, task: str, status: str, reward: float | None) -> None:
        stats = self.tasks.get(task)
        if stats is None:
            if len(self.tasks) >= MAX_TASKS:
                self.tasks.popitem(last=False)
            stats = self.tasks[task] = _Task()
        else:
            self.tasks.move_to_end(task)
        stats.rollouts += 1
        if status == "success":
            stats.success += 1
        elif status == "failure":
            stats.failure += 1
        else:
            stats.cancelled += 1
        if reward is not None:
            stats.rewarded += 1
            stats.reward_sum += reward
            stats.passed += reward >= 1.0
            stats.positive += reward > 0.0
        if status != "cancelled":
            stats.recent.append(reward if status == "success" else None)

    def _group(self, group: str, task: str | None, reward: float | None) -> None:
        stats = self.groups.get(group)
        if stats is None:
            if len(self.groups) >= MAX_GROUPS:
                gone, _ = self.groups.popitem(last=False)
                self.equal_groups.pop(gone, None)
            stats = self.groups[group] = _Group(task=task, reward=reward)
        else:
            self.groups.move_to_end(group)
        stats.rollouts += 1
        stats.equal = stats.equal and reward is not None and reward == stats.reward
        if stats.equal and stats.rollouts >= 2:
            self.equal_groups[group] = stats
            self.equal_groups.move_to_end(group)
        else:
            self.equal_groups.pop(group, None)

    # ------------------------------------------------------------------ the page's data

    def data(
        self,
        live: Iterable[RolloutEntry],
        live_counts: Mapping[str, int],
        *,
        nodes: list[dict[str, Any]] | None,
        package_cache: Mapping[str, float],
    ) -> dict[str, Any]:
        """Everything the console shows, as JSON-ready data."""
        now = time.time()
        running: list[dict[str, Any]] = []
        for entry in live:
            phase, since = _phase(entry)
            running.append(
                {
                    "rollout_id": entry.rollout_id,
                    "task": entry.task_name,
                    "status": entry.status.value,
                    "phase": phase,
                    "phase_sec": round(now - since, 1) if since is not None else None,
                    "age_sec": round(now - entry.wall_admitted, 1),
                    "running_sec": round(now - entry.wall_running, 1)
                    if entry.wall_running is not None
                    else None,
                }
            )
        running.sort(key=lambda item: -item["age_sec"])
        failures = sorted(self.failures.values(), key=lambda f: (-f.count, -f.last_at))
        tasks = [self._task_row(name, stats) for name, stats in self.tasks.items()]
        tasks.sort(key=lambda row: (-row["rollouts"], row["task"]))
        groups: list[dict[str, Any]] = []
        for name, stats in reversed(self.equal_groups.items()):
            if len(groups) >= 100:
                break
            groups.append(
                {
                    "group": name,
                    "task": stats.task,
                    "rollouts": stats.rollouts,
                    "reward": stats.reward,
                }
            )
        return {
            "time": now,
            "started_at": self.started_at,
            "counts": {**live_counts, **self.counts},
            "running": running[:100],
            "running_total": len(running),
            "recent": [
                dict(zip(_RECENT_FIELDS, item, strict=True)) for item in reversed(self.recent)
            ],
            "failures": [
                {
                    "category": f.category,
                    "origin": f.origin,
                    "reason": f.reason,
                    "count": f.count,
                    "last_rollout_id": f.last_rollout_id,
                }
                for f in failures[:50]
            ],
            "phases": _percentiles(self.phases),
            "node_phases": {
                node: _percentiles(phases) for node, phases in sorted(self.node_phases.items())
            },
            "tasks": tasks[:500],
            "tasks_total": len(tasks),
            "groups_all_equal": groups,
            "groups_all_equal_total": len(self.equal_groups),
            "groups_total": len(self.groups),
            "package_cache": dict(package_cache),
            "nodes": nodes or [],
        }

    @staticmethod
    def _task_row(name: str, stats: _Task) -> dict[str, Any]:
        finished = stats.success + stats.failure
        flag = None
        if finished >= FLAG_MIN:
            if stats.positive == 0:
                flag = "always_fails"
            elif stats.failure == 0 and stats.passed == finished:
                flag = "always_passes"
        return {
            "task": name,
            "rollouts": stats.rollouts,
            "success": stats.success,
            "failure": stats.failure,
            "cancelled": stats.cancelled,
            "mean_reward": round(stats.reward_sum / stats.rewarded, 4) if stats.rewarded else None,
            "pass_rate": round(stats.passed / finished, 4) if finished else None,
            "recent_rewards": list(stats.recent),
            "flag": flag,
        }


def _phase(entry: RolloutEntry) -> tuple[str, float | None]:
    """Where a live rollout is, and since when (Unix seconds): ``queued``; ``starting``
    (running, its agent not yet started: HarborBackend builds the image, starts the
    container, sets it up); ``agent``; ``verifier`` (grading); ``teardown`` (its trial's
    last phase ended: logs copied back, containers removed)."""
    status = entry.status
    if status is RolloutStatus.QUEUED:
        return "queued", entry.wall_admitted
    teardown = getattr(entry.context, "teardown_started_at", None)
    if isinstance(teardown, datetime):
        return "teardown", teardown.timestamp()
    if status is RolloutStatus.GRADING:
        return "verifier", None
    started = getattr(entry.context, "agent_started_at", None)
    if isinstance(started, datetime):
        return "agent", started.timestamp()
    return "starting", entry.wall_running


_RECENT_FIELDS: Final = (
    "rollout_id",
    "task",
    "status",
    "reward",
    "seconds",
    "err_category",
    "reason",
    "node",
    "finished_at",
)


def _percentiles(phases: Mapping[str, deque[float]]) -> dict[str, dict[str, float | int]]:
    shown: dict[str, dict[str, float | int]] = {}
    for name, window in phases.items():
        ordered = sorted(window)
        if not ordered:
            continue
        shown[name] = {
            "count": len(ordered),
            "p50": round(_quantile(ordered, 0.50), 4),
            "p95": round(_quantile(ordered, 0.95), 4),
            "p99": round(_quantile(ordered, 0.99), 4),
        }
    return shown


def _quantile(ordered: list[float], q: float) -> float:
    """The nearest-rank quantile of sorted ``ordered``."""
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]
