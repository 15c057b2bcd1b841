"""Best-effort trajectory files, one per rollout, with secrets redacted.

``<artifact_root>/<rollout_id>/trajectory.json`` is an ATIF-style document
(schema ``ATIF-v1.7``: one step per message) built from the saved sample; backend
diagnostics go to ``diagnostics.json`` beside it. Documents are built, redacted
and written on one background thread, so the event loop pays only a queue put
per rollout. Nothing here ever raises into a rollout.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from harbor_exec import __version__
from harbor_exec.authoring import RolloutSample

__all__ = [
    "REDACTED",
    "TrajectoryWriter",
    "build_trajectory_document",
    "redact_secrets",
]

logger = logging.getLogger(__name__)

REDACTED: Final = "[REDACTED]"
# Shorter "secrets" are not worth scrubbing out of every string (and would
# mangle ordinary text).
_MIN_SECRET_LEN: Final = 4
_SECRET_KEY = re.compile(
    r"(?:^|_)(?:api_?key|authorization|credentials?|password|secret|token)$", re.IGNORECASE
)
_ROLE_TO_SOURCE: Final = {"system": "system", "developer": "system", "user": "user"}
_AGENT_ROLES: Final = frozenset({"assistant"})
_TOOL_ROLES: Final = frozenset({"tool", "function"})


def redact_secrets(value: Any, secrets: Iterable[str]) -> Any:
    """Copy ``value`` with each secret string replaced, and values under secret-looking
    keys (``api_key``, ``authorization``, ``*_token``, ...) redacted."""
    needles = sorted({s for s in secrets if s and len(s) >= _MIN_SECRET_LEN}, key=len, reverse=True)

    def scrub(item: Any) -> Any:
        if isinstance(item, str):
            for needle in needles:
                if needle in item:
                    item = item.replace(needle, REDACTED)
            return item
        if isinstance(item, Mapping):
            return {
                key: (
                    REDACTED
                    if isinstance(key, str) and _SECRET_KEY.search(key) and sub is not None
                    else scrub(sub)
                )
                for key, sub in item.items()
            }
        if isinstance(item, list | tuple):
            return [scrub(sub) for sub in item]
        return item

    return scrub(value)


def build_trajectory_document(
    rollout_id: str,
    sample: RolloutSample,
    *,
    label: str | None,
    metadata: dict[str, Any] | None,
    extra_fields: dict[str, Any] | None,
) -> dict[str, Any]:
    """One rollout's trajectory: a step per message, tool results folded into the
    preceding agent step, and the real reward (even when the wire nulled it)."""
    steps: list[dict[str, Any]] = []
    for message in sample.trajectory_messages or ():
        role = str(message.get("role", "user"))
        if role in _TOOL_ROLES and steps and steps[-1]["source"] == "agent":
            result = {"content": message.get("content")}
            if message.get("tool_call_id") is not None:
                result["source_call_id"] = message.get("tool_call_id")
            steps[-1].setdefault("observation", {"results": []})["results"].append(result)
            continue
        source = "agent" if role in _AGENT_ROLES else _ROLE_TO_SOURCE.get(role, "user")
        step: dict[str, Any] = {
            "step_id": len(steps) + 1,
            "source": source,
            "message": message.get("content"),
        }
        if source == "agent":
            for key in ("tool_calls", "reasoning_content"):
                if message.get(key) is not None:
                    step[key] = message[key]
        if role not in _ROLE_TO_SOURCE and role not in _AGENT_ROLES:
            step["extra"] = {"original_role": role}
        steps.append(step)
    return {
        "schema_version": "ATIF-v1.7",
        "session_id": rollout_id,
        "trajectory_id": rollout_id,
        "agent": {"name": "harbor-exec", "version": __version__},
        "steps": steps,
        "final_metrics": {"total_steps": len(steps)},
        "extra": {
            "harbor_exec": {
                "rollout_id": rollout_id,
                "label": sample.label if sample.label is not None else label,
                "reward": sample.reward,
                "remove_sample": sample.remove_sample,
                "sample_metrics": sample.metrics,
                "sample_extra_fields": sample.extra_fields,
                "request_metadata": metadata,
                "request_extra_fields": extra_fields,
            }
        },
    }


def _encode(document: Any) -> bytes:
    try:
        return json.dumps(document, ensure_ascii=False, indent=2, allow_nan=False).encode()
    except (TypeError, ValueError):
        # Free-form metrics may hold NaN or foreign objects: keep the rest.
        return json.dumps(_json_clean(document), ensure_ascii=False, indent=2).encode()


def _json_clean(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_clean(v) for v in value]
    return str(value)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as handle:
        handle.write(data)
    os.replace(partial, path)


_Job = Callable[[], None]


class TrajectoryWriter:
    """Writes trajectory and diagnostics files on one daemon thread.

    ``save`` never blocks: beyond ``max_pending`` queued jobs it drops the file
    and counts it (``dropped``). ``close`` drains what is queued, up to a timeout.
    """

    def __init__(self, artifact_root: Path, *, max_pending: int = 10_000) -> None:
        self.artifact_root = artifact_root
        self.max_pending = max_pending
        self.dropped = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def save(
        self,
        rollout_id: str,
        *,
        sample: RolloutSample | None,
        diagnostics: dict[str, Any] | None,
        label: str | None,
        metadata: dict[str, Any] | None,
        extra_fields: dict[str, Any] | None,
        secrets: tuple[str, ...],
    ) -> None:
        """Queue the files of one rollout (nothing when there is neither sample nor diagnostics)."""
        if sample is not None and sample.trajectory_messages is None:
            sample = None  # trajectory persistence turned off by the workflow
        if (sample is None and diagnostics is None) or self._closed:
            return
        directory = self.artifact_root / rollout_id

        def job() -> None:
            if diagnostics is not None:
                payload = redact_secrets(diagnostics, secrets)
                _write_atomic(directory / "diagnostics.json", _encode(payload))
            if sample is not None:
                document = build_trajectory_document(
                    rollout_id,
                    sample,
                    label=label,
                    metadata=metadata,
                    extra_fields=extra_fields,
                )
                _write_atomic(
                    directory / "trajectory.json", _encode(redact_secrets(document, secrets))
                )

        with self._idle:
            if self._pending >= self.max_pending:
                self.dropped += 1
                return
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="harbor-exec-trajectories", daemon=True
                )
                self._thread.start()
        self._jobs.put(job)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued file is written; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Drain the queue (up to ``timeout``) and stop the thread."""
        self._closed = True
        self.flush(timeout)
        thread = self._thread
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)
            self._thread = None

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                self.dropped += 1
                logger.warning("could not write a trajectory file", exc_info=True)
            finally:
                with self._idle:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.notify_all()
