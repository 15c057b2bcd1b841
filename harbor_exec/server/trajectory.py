"""Best-effort trajectory files, one per rollout, with secrets redacted.

``<artifact_root>/<rollout_id>/trajectory.json`` is an ATIF-style document
(schema ``ATIF-v1.7``: one step per message) built from the saved sample; backend
diagnostics go to ``diagnostics.json`` beside it. Documents are built, redacted
and written on one background thread in batches, so the event loop pays only a
list append per rollout. Nothing here ever raises into a rollout.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from harbor_exec import __version__
from harbor_exec.authoring import RolloutSample
from harbor_exec.container.redaction import REDACTED, needles, redact
from harbor_exec.protocol import rollout_dir_name

__all__ = [
    "REDACTED",
    "TrajectoryWriter",
    "build_trajectory_document",
    "encode_redacted",
    "redact_secrets",
]

logger = logging.getLogger(__name__)

_SECRET_WORDS = r"(?:api_?key|authorization|credentials?|password|secret|token)"
_SECRET_KEY = re.compile(rf"(?:^|_){_SECRET_WORDS}$", re.IGNORECASE)
# A cheap pre-filter on lower-cased encoded text: could any object key be a
# secret one? (A false hit only costs the structural walk.)
_SECRET_KEY_HINT = re.compile(r'(?:key|authorization|credentials?|password|secret|token)":')
_ROLE_TO_SOURCE: Final = {"system": "system", "developer": "system", "user": "user"}
_AGENT_ROLES: Final = frozenset({"assistant"})
_TOOL_ROLES: Final = frozenset({"tool", "function"})


def redact_secrets(value: Any, secrets: Iterable[str]) -> Any:
    """Copy ``value`` with each secret string replaced, and values under secret-looking
    keys (``api_key``, ``authorization``, ``*_token``, ...) redacted."""
    secrets = needles(secrets)

    def scrub(item: Any) -> Any:
        if isinstance(item, str):
            return redact(item, secrets)
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


def _dumps(document: Any) -> str:
    # Compact on purpose: with ``indent`` json falls back to its pure-Python
    # encoder, several times slower.
    try:
        return json.dumps(document, allow_nan=False)
    except (TypeError, ValueError):
        # Free-form metrics may hold NaN or foreign objects: keep the rest.
        return json.dumps(_json_clean(document))


def encode_redacted(document: Any, secrets: Iterable[str]) -> bytes:
    """``document`` as JSON bytes with secrets redacted.

    Fast path on the encoded text: one substring replace per secret (in its
    JSON-escaped form), and the structural walk for secret-looking keys only
    when such a key occurs at all.
    """
    text = _dumps(document)
    if _SECRET_KEY_HINT.search(text.lower()):
        text = _dumps(redact_secrets(document, secrets))
    # Each secret as it appears in the encoded text.
    text = redact(text, [json.dumps(secret)[1:-1] for secret in needles(secrets)])
    return text.encode()


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


def _write(directory: str, name: str, data: bytes) -> None:
    path = os.path.join(directory, name)
    try:
        handle = open(path, "wb")  # noqa: SIM115 - the directory usually exists already
    except FileNotFoundError:
        os.makedirs(directory, exist_ok=True)
        handle = open(path, "wb")  # noqa: SIM115
    with handle:
        handle.write(data)


_Job = Callable[[], None]


class TrajectoryWriter:
    """Writes trajectory and diagnostics files on one daemon thread, in batches.

    ``save`` never blocks and wakes the thread only when a batch starts (the
    thread then waits ``batch_delay_sec`` for more), so the event loop does not
    hand the GIL back and forth per rollout. Beyond ``max_pending`` queued
    rollouts it drops files and counts them (``dropped``). ``close`` drains the
    queue, up to a timeout.
    """

    def __init__(
        self,
        artifact_root: Path,
        *,
        max_pending: int = 10_000,
        batch_delay_sec: float = 0.05,
    ) -> None:
        self.artifact_root = artifact_root
        self.max_pending = max_pending
        self.batch_delay_sec = batch_delay_sec
        self.dropped = 0
        self._batch: list[_Job] = []
        self._pending = 0
        self._lock = threading.Condition()
        self._wakeups: queue.SimpleQueue[bool] = queue.SimpleQueue()
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
        # A string path: pathlib would intern the id for good on CPython 3.12.
        directory = os.path.join(os.fspath(self.artifact_root), rollout_dir_name(rollout_id))

        def job() -> None:
            if diagnostics is not None:
                _write(directory, "diagnostics.json", encode_redacted(diagnostics, secrets))
            if sample is not None:
                document = build_trajectory_document(
                    rollout_id, sample, label=label, metadata=metadata, extra_fields=extra_fields
                )
                _write(directory, "trajectory.json", encode_redacted(document, secrets))

        with self._lock:
            if self._pending >= self.max_pending:
                self.dropped += 1
                return
            self._pending += 1
            self._batch.append(job)
            start_batch = len(self._batch) == 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="harbor-exec-trajectories", daemon=True
                )
                self._thread.start()
        if start_batch:
            self._wakeups.put(True)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued file is written; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Drain the queue (up to ``timeout``) and stop the thread."""
        self._closed = True
        self.flush(timeout)
        thread = self._thread
        if thread is not None:
            self._wakeups.put(False)
            thread.join(timeout)
            self._thread = None

    def _work(self) -> None:
        while self._wakeups.get():
            time.sleep(self.batch_delay_sec)
            with self._lock:
                batch, self._batch = self._batch, []
            done = len(batch)
            while batch:
                # Popped, not iterated: a finished job (and the sample it holds)
                # must not stay referenced until the next batch.
                job = batch.pop()
                try:
                    job()
                except Exception:
                    self.dropped += 1
                    logger.warning("could not write a trajectory file", exc_info=True)
                del job
            with self._lock:
                self._pending -= done
                self._lock.notify_all()
