"""One chat completion through the rollout's chat endpoint, osmosis-ai style.

``metadata`` drives the variants a side-by-side test needs: ``raise`` (a
``RuntimeError`` with that message), ``raise_value`` (a ``ValueError``),
``use_source`` (register an SDK ``SampleSource`` and return None), ``no_sample``
(return None without one), ``artifact`` (write ``answer.txt`` to ``artifacts_dir``).
"""

from __future__ import annotations

from typing import Any

import httpx
from osmosis_ai.rollout import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    RolloutSample,
    RolloutStatus,
    SampleSource,
    get_rollout_context,
)

SYSTEM_PROMPT = "You are a calculator. Reply with the numeric answer only."


class SdkArithConfig(AgentWorkflowConfig):
    model: str = "osmosis-rollout"


class _MessagesSource(SampleSource):
    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages

    async def get_sample(self) -> RolloutSample:
        return RolloutSample(messages=self.messages, metrics={"from_source": 1.0})


class SdkArithWorkflow(AgentWorkflow[SdkArithConfig]):
    async def run(
        self, ctx: AgentWorkflowContext[SdkArithConfig]
    ) -> AgentWorkflowOutput | None:
        script = ctx.metadata or {}
        if script.get("raise"):
            raise RuntimeError(str(script["raise"]))
        if script.get("raise_value"):
            raise ValueError(str(script["raise_value"]))
        rollout = get_rollout_context()
        if rollout is None or not rollout.chat_completions_url:
            raise RuntimeError("no chat endpoint: run this workflow inside a rollout")
        # A status report through the SDK's context (the server sees "running").
        await rollout.set_status(RolloutStatus.RUNNING)
        config = ctx.config or SdkArithConfig(name="sdk-arith")
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        messages += [dict(m) for m in ctx.prompt]
        headers = {"Authorization": f"Bearer {rollout.api_key}"} if rollout.api_key else {}
        url = rollout.chat_completions_url.rstrip("/") + "/chat/completions"
        body = {"model": config.model, "messages": messages}
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.post(url, json=body, headers=headers)
            response.raise_for_status()
        data = response.json()
        messages.append(
            {"role": "assistant", "content": data["choices"][0]["message"]["content"] or ""}
        )
        if script.get("artifact") and ctx.artifacts_dir is not None:
            (ctx.artifacts_dir / "answer.txt").write_text(messages[-1]["content"] + "\n")
        if script.get("no_sample"):
            return None
        if script.get("use_source"):
            rollout.set_sample_source(_MessagesSource(messages))
            return None
        usage = data.get("usage") or {}
        metrics = {k: float(v) for k, v in usage.items() if isinstance(v, int | float)}
        metrics["turns"] = 1.0
        return AgentWorkflowOutput(messages=messages, metrics=metrics)


workflow_config = SdkArithConfig(name="sdk-arith", model="sdk-model")
