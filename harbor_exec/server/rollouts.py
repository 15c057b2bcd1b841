"""Rollouts you can list: ``GET /rollouts`` and ``GET /rollouts/{id}``.

What the server keeps of a rollout besides its wire result: the task (what the backend
reported, else the request's ``metadata.harbor_task_id``, ``harbor_task`` or ``task``),
its wall-clock times, and a small report built when it finishes (``rollout_info``): the
failure's message with every known secret scrubbed, and, from the backend's
diagnostics, the node, the trial, its directory, the phase it ended in and the phases'
timings. With a store (``--data-dir``) rollouts are read from SQLite (``store.py``,
history included); without one, from the registry (what is held until retention ends).

Nothing here shows a key: the LLM key is never stored, the server's key and the LLM key
are scrubbed from messages before they are kept, and the request's metadata is shown
with values under secret-looking keys redacted.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from starlette.datastructures import QueryParams

from harbor_exec.container.redaction import redact
from harbor_exec.protocol import (
    ExecutionResult,
    RolloutDetail,
    RolloutErrorCategory,
    RolloutFile,
    RolloutList,
    RolloutPhase,
    RolloutStatus,
    RolloutSummary,
    rollout_dir_name,
)
from harbor_exec.server.http import query_error
from harbor_exec.server.registry import RolloutEntry
from harbor_exec.server.store import RolloutQuery, RolloutRecord
from harbor_exec.server.trajectory import redact_secrets

__all__ = [
    "DEFAULT_PAGE",
    "MAX_PAGE",
    "MAX_REASON_CHARS",
    "detail_of",
    "page_of",
    "parse_query",
    "read_file",
    "record_of",
    "rollout_info",
    "select_entries",
    "task_of",
]

DEFAULT_PAGE: Final = 50
MAX_PAGE: Final = 1000
MAX_REASON_CHARS: Final = 500
MAX_TASK_CHARS: Final = 512
#: Metadata keys that name a rollout's task when the backend reports none, in order.
TASK_KEYS: Final = ("harbor_task_id", "harbor_task", "task")
#: The backend diagnostics kept for listing (HarborBackend's names), and their types.
_KEPT: Final = (("task", str), ("node", str), ("trial", str), ("trial_dir", str), ("phase", str))
# A trial directory's files worth opening, by name (Harbor's layout).
_TRIAL_FILES: Final = (
    ("result", "result.json"),
    ("exception", "exception.txt"),
    ("verifier_output", "verifier/test-stdout.txt"),
    ("verifier_reward", "verifier/reward.json"),
    ("verifier_reward", "verifier/reward.txt"),
    ("agent_logs", "agent"),
    ("artifacts", "artifacts"),
)
_ROLLOUT_FILES: Final = (("trajectory", "trajectory.json"), ("diagnostics", "diagnostics.json"))
#: Files of a trial's ``agent/`` listed, at most; a file's text served, at most (its tail).
MAX_AGENT_FILES: Final = 50
MAX_FILE_BYTES: Final = 1 << 20


def task_of(metadata: Mapping[str, Any] | None) -> str | None:
    """The task a request names in its metadata (None when it names none)."""
    if not metadata:
        return None
    for key in TASK_KEYS:
        value = metadata.get(key)
        if isinstance(value, str) and value:
            return value[:MAX_TASK_CHARS]
    return None


def rollout_info(result: ExecutionResult, secrets: Iterable[str]) -> dict[str, Any] | None:
    """What the server keeps of a finished rollout's report: the scrubbed failure
    message (``reason``) and the backend diagnostics listed in ``_KEPT`` plus the
    phases' timings. None when there is nothing (a plain success in-process)."""
    diagnostics = result.extra_fields
    message = result.err_message
    if not diagnostics and not message:
        return None
    info: dict[str, Any] = {}
    if message:
        info["reason"] = redact(message, secrets)[:MAX_REASON_CHARS]
    if diagnostics:
        for key, kind in _KEPT:
            value = diagnostics.get(key)
            if isinstance(value, kind):
                info[key] = redact(value, secrets)[:MAX_TASK_CHARS]
        timings = diagnostics.get("timings_sec")
        if isinstance(timings, Mapping):
            info["timings_sec"] = {
                str(name): float(seconds)
                for name, seconds in timings.items()
                if isinstance(seconds, int | float) and math.isfinite(seconds)
            }
    return info or None


# ---------------------------------------------------------------------------- queries


def parse_query(params: QueryParams) -> RolloutQuery | list[dict[str, Any]]:
    """``GET /rollouts``'s query (``status``, ``task``, ``since``, ``until``, ``cursor``,
    ``limit``) or the 422's errors."""
    errors: list[dict[str, Any]] = []
    status = params.get("status")
    if status is not None and status not in _STATUSES:
        errors.append(query_error("status", status, "a rollout status"))
    task = params.get("task")
    if task is not None and not task:
        errors.append(query_error("task", task, "a task name"))
    since, until = _seconds(params, "since", errors), _seconds(params, "until", errors)
    before = _integer(params, "cursor", 1, None, "a cursor from next_cursor", errors)
    limit = _integer(params, "limit", 1, MAX_PAGE, f"an integer from 1 to {MAX_PAGE}", errors)
    if errors:
        return errors
    return RolloutQuery(
        status=status,
        task=task,
        since=since,
        until=until,
        before=before,
        limit=DEFAULT_PAGE if limit is None else limit,
    )


_STATUSES: Final = frozenset(status.value for status in RolloutStatus)


def _seconds(params: QueryParams, name: str, errors: list[dict[str, Any]]) -> float | None:
    raw = params.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        errors.append(query_error(name, raw, "a time in Unix seconds"))
        return None
    return value


def _integer(
    params: QueryParams,
    name: str,
    low: int,
    high: int | None,
    expected: str,
    errors: list[dict[str, Any]],
) -> int | None:
    raw = params.get(name)
    if raw is None:
        return None
    value = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else None
    if value is None or value < low or (high is not None and value > high):
        errors.append(query_error(name, raw, expected))
        return None
    return value


def select_entries(entries: Iterable[RolloutEntry], query: RolloutQuery) -> list[RolloutRecord]:
    """``query`` over the registry's entries (in admission order), newest first."""
    chosen: list[RolloutRecord] = []
    for entry in reversed(list(entries)):
        if query.before is not None and entry.seq >= query.before:
            continue
        if query.status is not None and entry.status.value != query.status:
            continue
        if query.task is not None and entry.task_name != query.task:
            continue
        if query.since is not None and entry.wall_admitted < query.since:
            continue
        if query.until is not None and entry.wall_admitted >= query.until:
            continue
        chosen.append(record_of(entry))
        if len(chosen) >= query.limit:
            break
    return chosen


def record_of(entry: RolloutEntry) -> RolloutRecord:
    """A registry entry as a listed rollout."""
    final = entry.final
    return RolloutRecord(
        seq=entry.seq,
        rollout_id=entry.rollout_id,
        status=entry.status.value,
        task=entry.task_name,
        admitted_at=entry.wall_admitted,
        running_at=entry.wall_running,
        finished_at=entry.wall_finished,
        reward=final.reward if final else None,
        err_category=final.err_category.value if final and final.err_category else None,
        err_message=final.err_message if final else None,
        detail=entry.info,
        request={"metadata": entry.metadata} if entry.metadata else None,
        final_body=final.body if final else None,
    )


# ---------------------------------------------------------------------------- answers


def page_of(records: list[RolloutRecord], limit: int) -> RolloutList:
    """A page of ``records`` (fetched ``limit + 1``, so a further one says there is more)."""
    more = len(records) > limit
    shown = records[:limit]
    return RolloutList(
        rollouts=[_summary(record) for record in shown],
        next_cursor=str(shown[-1].seq) if more and shown else None,
    )


def _summary(record: RolloutRecord) -> RolloutSummary:
    return RolloutSummary.model_construct(**_summary_fields(record))


def _summary_fields(record: RolloutRecord) -> dict[str, Any]:
    detail = record.detail if isinstance(record.detail, dict) else {}
    finished = record.finished_at
    reason = detail.get("reason")
    if reason is None and record.err_message is not None:
        # Finished by the server itself (lease, cancel, restart): its own words.
        reason = record.err_message[:MAX_REASON_CHARS]
    return {
        "rollout_id": record.rollout_id,
        "status": RolloutStatus(record.status),
        "task": record.task,
        "admitted_at": _time(record.admitted_at),
        "finished_at": _time(finished) if finished is not None else None,
        "seconds": finished - record.admitted_at if finished is not None else None,
        "reward": _finite(record.reward),
        "err_category": _category(record.err_category),
        "reason": reason,
        "node": detail.get("node"),
    }


def detail_of(record: RolloutRecord, artifact_root: Path, secrets: Iterable[str]) -> RolloutDetail:
    """``GET /rollouts/{id}``'s body for ``record``."""
    secrets = tuple(secrets)
    fields = _summary_fields(record)
    detail = record.detail if isinstance(record.detail, dict) else {}
    phases: list[RolloutPhase] = []
    if record.running_at is not None:
        phases.append(
            RolloutPhase(
                name="queued", source="server", seconds=record.running_at - record.admitted_at
            )
        )
        end = record.finished_at
        if end is not None:
            phases.append(
                RolloutPhase(name="running", source="server", seconds=end - record.running_at)
            )
    timings = detail.get("timings_sec")
    if isinstance(timings, dict):
        phases.extend(
            RolloutPhase(name=str(name), source="backend", seconds=_finite(seconds))
            for name, seconds in timings.items()
        )
    request = record.request if isinstance(record.request, dict) else {}
    metadata = request.get("metadata")
    trial_dir = detail.get("trial_dir")
    return RolloutDetail(
        **fields,
        running_at=_time(record.running_at) if record.running_at is not None else None,
        phases=phases,
        trial=detail.get("trial"),
        trial_dir=trial_dir,
        phase=detail.get("phase"),
        metadata=redact_secrets(metadata, secrets) if isinstance(metadata, dict) else None,
        metrics=_metrics(record.final_body),
        files=_files(record.rollout_id, artifact_root, trial_dir),
    )


def _candidates(
    rollout_id: str, artifact_root: Path, trial_dir: str | None
) -> list[tuple[str, Path, Path]]:
    """(name, path, the directory it must stay in) of every file a rollout may have."""
    candidates: list[tuple[str, Path, Path]] = []
    if trial_dir:
        root = Path(trial_dir)
        candidates.append(("trial_dir", root, root))
        candidates.extend((name, root / relative, root) for name, relative in _TRIAL_FILES)
        agent = root / "agent"
        try:
            listed = agent.is_dir() and not agent.is_symlink()
            logs = sorted(agent.iterdir())[:MAX_AGENT_FILES] if listed else []
        except OSError:
            logs = []
        candidates.extend((f"agent/{path.name}", path, root) for path in logs)
    own = artifact_root / rollout_dir_name(rollout_id)
    candidates.extend((name, own / relative, own) for name, relative in _ROLLOUT_FILES)
    return candidates


def _files(rollout_id: str, artifact_root: Path, trial_dir: str | None) -> list[RolloutFile]:
    found: list[RolloutFile] = []
    prefix = f"/rollouts/{quote(rollout_id, safe='')}/files/"
    for name, path, root in _candidates(rollout_id, artifact_root, trial_dir):
        try:
            exists = path.exists()
        except OSError:
            exists = False
        if exists:
            readable = _within(path, root) is not None
            url = prefix + quote(name, safe="/") if readable else None
            found.append(RolloutFile(name=name, path=str(path), url=url))
    return found


def _within(path: Path, root: Path) -> Path | None:
    """``path`` when it is a regular file, not a link, inside ``root`` (resolved)."""
    try:
        if path.is_symlink() or not path.is_file():
            return None
        if not path.resolve().is_relative_to(root.resolve()):
            return None
    except OSError:
        return None
    return path


def read_file(
    record: RolloutRecord, artifact_root: Path, name: str, secrets: Iterable[str]
) -> tuple[bytes, str] | None:
    """The text of the rollout's file ``name`` (one ``RolloutFile.name``) and its media
    type: its last ``MAX_FILE_BYTES``, scrubbed of ``secrets``; None when there is none."""
    detail = record.detail if isinstance(record.detail, dict) else {}
    trial_dir = detail.get("trial_dir")
    for candidate, path, root in _candidates(
        record.rollout_id, artifact_root, trial_dir if isinstance(trial_dir, str) else None
    ):
        if candidate != name:
            continue
        if _within(path, root) is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            cut = size > MAX_FILE_BYTES
            if cut:
                handle.seek(size - MAX_FILE_BYTES)
            data = handle.read(MAX_FILE_BYTES)
        text = redact(data.decode("utf-8", "replace"), secrets)
        if cut:
            text = f"[... the first {size - MAX_FILE_BYTES} bytes left out ...]\n" + text
        media = "application/json" if path.suffix == ".json" and not cut else "text/plain"
        return text.encode(), f"{media}; charset=utf-8"
    return None


def _metrics(body: bytes | None) -> dict[str, float] | None:
    if not body:
        return None
    try:
        sample = json.loads(body).get("sample")
    except (ValueError, AttributeError):
        return None
    metrics = sample.get("metrics") if isinstance(sample, dict) else None
    if not isinstance(metrics, dict):
        return None
    return {
        str(name): float(value)
        for name, value in metrics.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


def _time(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _finite(value: object) -> float | None:
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def _category(value: str | None) -> RolloutErrorCategory | None:
    try:
        return RolloutErrorCategory(value) if value else None
    except ValueError:
        return None
