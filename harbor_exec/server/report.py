"""What ``serve`` prints while it runs: what it serves, a line per finished rollout and a
periodic summary, as text for a terminal or JSON lines for a log collector.

* At start (``ServeReport.start``, in the app's lifespan once the backend started and the
  store was read back): one ``serving`` record with the facts the command gave
  (``facts``: tasks and mode, agent, verifier mode, capacity and queue bound, directories,
  package cache) and the server's own (its data dir, rollouts restored, Ray nodes).
* Per finished rollout (``ServeReport.finished``, from ``RolloutService._finish``, which
  runs once per rollout): id, task, status, reward, seconds from admission, and for a
  rollout that did not succeed its category and reason (scrubbed of keys, one line).
* Every ``summary_interval_sec`` while anything is live or happened since the last one:
  queued, running, and since start done (success), failed, cancelled; the mean reward of
  the rollouts that finished in that window (an idle server prints nothing more).

Lines are collected on the event loop and written in one ``write`` at most every 0.2 s
(and at stop), so a busy server does not pay a system call per rollout.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final, Literal, TextIO

__all__ = ["LOG_FORMATS", "LogFormat", "ServeReport"]

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final = ("text", "json")
_FLUSH_SEC: Final = 0.2
_REASON_CHARS: Final = 300

#: What the summary reads from the server: (queued, running) now.
LiveCounts = Callable[[], tuple[int, int]]


class ServeReport:
    """The terminal's account of a running server (see the module doc)."""

    def __init__(
        self,
        *,
        log_format: LogFormat = "text",
        stream: TextIO | None = None,
        summary_interval_sec: float = 30.0,
        facts: Mapping[str, Any] | None = None,
    ) -> None:
        if log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be 'text' or 'json'; got {log_format!r}")
        self.log_format: LogFormat = log_format
        self.stream = stream
        self.summary_interval_sec = summary_interval_sec
        self.facts: dict[str, Any] = dict(facts or {})
        self.done = self.failed = self.cancelled = 0
        self._window_rewards: list[float] = []
        self._window_finished = 0
        self._pending: list[str] = []
        self._live: LiveCounts | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        self._summary_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, live: LiveCounts, server_facts: Mapping[str, Any]) -> None:
        """Print what is served and start the periodic summary (on the event loop)."""
        self._live = live
        self._loop = asyncio.get_running_loop()
        self._emit("serving", {**self.facts, **server_facts})
        self.flush()
        if self.summary_interval_sec > 0:
            self._summary_timer = self._loop.call_later(self.summary_interval_sec, self._tick)

    def stop(self) -> None:
        """A last summary (when anything happened since the one before) and every line out."""
        for timer in (self._flush_timer, self._summary_timer):
            if timer is not None:
                timer.cancel()
        self._flush_timer = self._summary_timer = None
        if self._live is not None:
            self.summary(force=False)
        self.flush()

    # ------------------------------------------------------------------ events

    def finished(
        self,
        rollout_id: str,
        *,
        task: str | None,
        status: str,
        reward: float | None,
        seconds: float,
        err_category: str | None,
        reason: str | None,
    ) -> None:
        """One finished rollout (called once per rollout)."""
        if status == "success":
            self.done += 1
        elif status == "failure":
            self.failed += 1
        else:
            self.cancelled += 1
        self._window_finished += 1
        if reward is not None:
            self._window_rewards.append(reward)
        record: dict[str, Any] = {
            "rollout_id": rollout_id,
            "task": task,
            "status": status,
            "reward": reward,
            "seconds": round(seconds, 3),
        }
        if status != "success":
            record["err_category"] = err_category
            record["reason"] = " ".join((reason or "").split())[:_REASON_CHARS] or None
        self._emit("rollout", record)

    def summary(self, *, force: bool = True) -> None:
        """The one-line summary now (skipped when idle and ``force`` is False)."""
        queued, running = self._live() if self._live is not None else (0, 0)
        if not force and not (queued or running or self._window_finished):
            return
        rewards = self._window_rewards
        self._emit(
            "summary",
            {
                "queued": queued,
                "running": running,
                "done": self.done,
                "failed": self.failed,
                "cancelled": self.cancelled,
                "window_sec": self.summary_interval_sec,
                "window_finished": self._window_finished,
                "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
                "rewards": len(rewards),
            },
        )
        self._window_rewards = []
        self._window_finished = 0

    def _tick(self) -> None:
        self.summary(force=False)
        if self._loop is not None:
            self._summary_timer = self._loop.call_later(self.summary_interval_sec, self._tick)

    # ------------------------------------------------------------------ output

    def _emit(self, event: str, record: Mapping[str, Any]) -> None:
        if self.log_format == "json":
            now = datetime.now(UTC).isoformat(timespec="milliseconds")
            line = json.dumps({"event": event, "time": now, **record}, ensure_ascii=False)
        else:
            line = _text(event, record)
        self._pending.append(line + "\n")
        if self._flush_timer is None and self._loop is not None:
            self._flush_timer = self._loop.call_later(_FLUSH_SEC, self._timed_flush)

    def _timed_flush(self) -> None:
        self._flush_timer = None
        self.flush()

    def flush(self) -> None:
        """Write the collected lines (one write)."""
        if not self._pending:
            return
        text = "".join(self._pending)
        self._pending = []
        stream = self.stream or sys.stdout
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed terminal must not fail the server


def _text(event: str, record: Mapping[str, Any]) -> str:
    if event == "rollout":
        reward = record["reward"]
        parts = [
            "rollout",
            str(record["rollout_id"]),
            f"task={record['task'] or '-'}",
            str(record["status"]),
            f"reward={'-' if reward is None else f'{reward:g}'}",
            f"{record['seconds']:.2f}s",
        ]
        if record["status"] != "success":
            category = record.get("err_category") or "-"
            reason = record.get("reason")
            parts.append(f"{category}: {reason}" if reason else category)
        return "  ".join(parts)
    if event == "summary":
        mean = record["mean_reward"]
        shown = "-" if mean is None else f"{mean:.3f} over {record['rewards']}"
        return (
            f"summary  queued={record['queued']} running={record['running']} "
            f"done={record['done']} failed={record['failed']} "
            f"cancelled={record['cancelled']}  mean reward (last "
            f"{record['window_sec']:g}s)={shown}"
        )
    lines = ["harbor-exec serve"]
    width = max((len(key) for key in record), default=0)
    for key, value in record.items():
        if value is None or value == "" or value == []:
            continue
        shown = ", ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
        lines.append(f"  {key.replace('_', ' '):<{width}}  {shown}")
    return "\n".join(lines)
