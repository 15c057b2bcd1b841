"""What a rollout's model relay counted (``harbor_exec.network.relay``), as the run's
usage and its sample's metrics."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelUsage"]


@dataclass
class ModelUsage:
    """What a rollout's model relay saw (the relay counts into it as calls happen).

    ``cached_tokens`` and ``cost_usd`` stay None until the upstream reports them
    (``usage.prompt_tokens_details.cached_tokens``, ``usage.cost``): nothing is
    priced here.
    """

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    rejected: int = 0  # bad token, over limits, wrong path
    upstream_errors: int = 0  # 502s: the upstream failed, timed out or answered too much
    cached_tokens: int | None = None  # of prompt_tokens, when the upstream says
    cost_usd: float | None = None  # as the upstream reported it

    def usage_metrics(self) -> dict[str, int | float]:
        """``input_tokens``, ``cached_tokens``, ``output_tokens``, ``cost_usd``, as
        osmosis-ai names a trial's usage; None values dropped."""
        values: dict[str, int | float | None] = {
            "input_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.completion_tokens,
            "cost_usd": self.cost_usd,
        }
        return {key: value for key, value in values.items() if value is not None}

    def sample_metrics(self) -> dict[str, int | float]:
        """The counts a rollout's sample reports as its metrics."""
        return {
            "llm_requests": self.requests,
            "llm_prompt_tokens": self.prompt_tokens,
            "llm_completion_tokens": self.completion_tokens,
            "llm_total_tokens": self.total_tokens,
            **self.usage_metrics(),
        }

    def disagreement(self, agent_usage: Any) -> dict[str, dict[str, Any]] | None:
        """Where the agent's own counts (``input_tokens``, ``cached_tokens``,
        ``output_tokens``, ``cost_usd``) differ from this relay's, by key with both
        values; None when they agree or the agent gave none. A missing count is no
        disagreement, and neither is a cost only one side knows (the agent may price
        from a table; the relay only reports what the upstream said)."""
        if not isinstance(agent_usage, Mapping):
            return None
        ours: dict[str, int | float | None] = {
            "input_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.completion_tokens,
            "cost_usd": self.cost_usd,
        }
        found: dict[str, dict[str, Any]] = {}
        for key, relay_value in ours.items():
            theirs = agent_usage.get(key)
            if theirs is None or isinstance(theirs, bool) or not isinstance(theirs, int | float):
                continue
            if key == "cost_usd":
                if relay_value is None or math.isclose(theirs, relay_value, rel_tol=1e-6):
                    continue
            elif (relay_value or 0) == theirs:
                continue
            found[key] = {"relay": relay_value, "agent": theirs}
        return found or None
