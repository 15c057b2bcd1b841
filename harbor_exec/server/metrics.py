"""In-process server metrics, rendered in the Prometheus text format (version 0.0.4).

Plain counters and fixed-bucket histograms: an observation is a bisect and
two additions, cheap enough for every rollout. No client library needed.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["PROMETHEUS_CONTENT_TYPE", "Histogram", "ServerMetrics"]

PROMETHEUS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; covers in-process workflows (ms) up to container trials (minutes).
_DURATION_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
)  # fmt: skip


class Histogram:
    """A cumulative-bucket histogram without labels."""

    __slots__ = ("_bounds", "_counts", "count", "sum")

    def __init__(self, bounds: Sequence[float] = _DURATION_BUCKETS) -> None:
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(self._bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self.count += 1
        self.sum += value

    def render(self, name: str) -> list[str]:
        lines: list[str] = []
        cumulative = 0
        for bound, count in zip(self._bounds, self._counts, strict=False):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {_number(self.sum)}")
        lines.append(f"{name}_count {self.count}")
        return lines


class ServerMetrics:
    """Counters the routes update; gauges are read at scrape time."""

    def __init__(self) -> None:
        self.admitted = 0
        self.rejected: dict[str, int] = {}
        self.completed: dict[tuple[str, str], int] = {}
        self.result_polls = 0
        self.rollout_seconds = Histogram()
        self.queued_seconds = Histogram()
        self.trajectories_dropped = 0

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def complete(self, status: str, err_category: str | None, seconds: float) -> None:
        key = (status, err_category or "")
        self.completed[key] = self.completed.get(key, 0) + 1
        self.rollout_seconds.observe(seconds)

    def render(self, gauges: Mapping[str, tuple[str, float | int | None]]) -> str:
        """The exposition text; ``gauges`` maps a name to (help, value), None skipped."""
        out: list[str] = []

        def header(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")

        header("harbor_exec_rollouts_admitted_total", "counter", "Rollouts admitted (202).")
        out.append(f"harbor_exec_rollouts_admitted_total {self.admitted}")
        header(
            "harbor_exec_rollouts_rejected_total",
            "counter",
            "Rollout submissions refused, by reason.",
        )
        for reason, count in sorted(self.rejected.items()):
            out.append(f'harbor_exec_rollouts_rejected_total{{reason="{_label(reason)}"}} {count}')
        header(
            "harbor_exec_rollouts_completed_total",
            "counter",
            "Rollouts finished, by status and error category.",
        )
        for (status, category), count in sorted(self.completed.items()):
            out.append(
                "harbor_exec_rollouts_completed_total"
                f'{{status="{_label(status)}",err_category="{_label(category)}"}} {count}'
            )
        header("harbor_exec_result_polls_total", "counter", "GET /rollout/{id}/result requests.")
        out.append(f"harbor_exec_result_polls_total {self.result_polls}")
        header(
            "harbor_exec_trajectories_dropped_total",
            "counter",
            "Trajectory files skipped because the writer was backlogged or failed.",
        )
        out.append(f"harbor_exec_trajectories_dropped_total {self.trajectories_dropped}")
        for name, (help_text, value) in gauges.items():
            if value is None:
                continue
            header(name, "gauge", help_text)
            out.append(f"{name} {_number(value)}")
        header(
            "harbor_exec_rollout_duration_seconds",
            "histogram",
            "Admission to final result.",
        )
        out.extend(self.rollout_seconds.render("harbor_exec_rollout_duration_seconds"))
        header(
            "harbor_exec_rollout_queued_seconds",
            "histogram",
            "Admission to running.",
        )
        out.extend(self.queued_seconds.render("harbor_exec_rollout_queued_seconds"))
        out.append("")
        return "\n".join(out)


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
