"""An arithmetic rollout, everything in one module as osmosis-ai's docs write it:
the workflow asks the model once; the grader gives 1.0 when the answer's last number
is the label. ``metadata``: ``raise`` (the workflow raises ``RuntimeError``)."""

from __future__ import annotations

import re
from typing import Any

import httpx
from osmosis_ai.rollout import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    Grader,
    GraderConfig,
    GraderContext,
    get_rollout_context,
)

SYSTEM_PROMPT = "You are a calculator. Reply with the numeric answer only."
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ArithConfig(AgentWorkflowConfig):
    model: str = "osmosis-rollout"


class ArithWorkflow(AgentWorkflow[ArithConfig]):
    async def run(self, ctx: AgentWorkflowContext[ArithConfig]) -> AgentWorkflowOutput:
        if (ctx.metadata or {}).get("raise"):
            raise RuntimeError(str(ctx.metadata["raise"]))
        rollout = get_rollout_context()
        if rollout is None or not rollout.chat_completions_url:
            raise RuntimeError("no chat endpoint: run this workflow inside a rollout")
        config = ctx.config or ArithConfig(name="one-arith")
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        messages += [dict(m) for m in ctx.prompt]
        headers = {"Authorization": f"Bearer {rollout.api_key}"} if rollout.api_key else {}
        url = rollout.chat_completions_url.rstrip("/") + "/chat/completions"
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.post(
                url, json={"model": config.model, "messages": messages}, headers=headers
            )
            response.raise_for_status()
        answer = response.json()["choices"][0]["message"]["content"] or ""
        messages.append({"role": "assistant", "content": answer})
        return AgentWorkflowOutput(messages=messages, metrics={"turns": 1.0})


class ArithGraderConfig(GraderConfig):
    tolerance: float = 1e-6


class ArithGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        if ctx.sample is None:
            raise ValueError("nothing to grade")
        numbers = _NUMBER.findall(str(ctx.sample.messages[-1].get("content") or ""))
        tolerance = getattr(self.config, "tolerance", 1e-6)
        right = bool(numbers) and abs(float(numbers[-1]) - float(ctx.label or "nan")) <= tolerance
        ctx.set_reward(1.0 if right else 0.0)
        ctx.sample.metrics["graded_by"] = "one-module"


workflow_config = ArithConfig(name="one-arith", model="one-model")
grader_config = ArithGraderConfig(name="one-arith-grader")
