"""Reward 1.0 when the agent called ``add`` and its last message holds the label.

The sample's ``messages`` are the OpenAI Agents session's items (Responses-API
shape), as osmosis-ai's ``SessionSampleSource`` gives them.
"""

from __future__ import annotations

import re
from typing import Any

from osmosis_ai.rollout import Grader, GraderConfig, GraderContext

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text") or "") for part in content or [] if isinstance(part, dict))


class AgentsArithGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        if ctx.sample is None:
            raise ValueError("nothing to grade")
        items = [item for item in ctx.sample.messages if isinstance(item, dict)]
        tool_calls = sum(1 for item in items if item.get("type") == "function_call")
        answers = [i for i in items if i.get("type") == "message" and i.get("role") == "assistant"]
        numbers = _NUMBER.findall(_text(answers[-1])) if answers else []
        right = bool(numbers) and float(numbers[-1]) == float(ctx.label or "nan")
        ctx.set_reward(1.0 if right and tool_calls else 0.0)
        ctx.sample.metrics["tool_calls"] = float(tool_calls)
        ctx.sample.metrics["items"] = float(len(items))


grader_config = GraderConfig(name="agents-arith-grader")
