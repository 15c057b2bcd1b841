"""An agent that asks a chat model an arithmetic question (its grader: ``grader.py``).

The chat endpoint follows the Osmosis convention: the rollout context's
``chat_completions_url`` is an OpenAI-compatible *base* URL (what OpenAI
clients call ``base_url``/``api_base``); requests go to
``{chat_completions_url}/chat/completions`` with the rollout's key as a bearer
token. The URL and key come only from the rollout context, never from config.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from harbor_exec.authoring import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    get_rollout_context,
)

SYSTEM_PROMPT = "You are a calculator. Reply with the numeric answer only."
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ArithWorkflowConfig(AgentWorkflowConfig):
    model: str = "osmosis-rollout"
    temperature: float = 0.0
    request_timeout_sec: float = 60.0


class ArithWorkflow(AgentWorkflow[ArithWorkflowConfig]):
    """One chat completion: the prompt (plus a system prompt) in, the reply appended."""

    async def run(self, ctx: AgentWorkflowContext[ArithWorkflowConfig]) -> AgentWorkflowOutput:
        rollout = get_rollout_context()
        if rollout is None or not rollout.chat_completions_url:
            raise RuntimeError("no chat endpoint: run this workflow inside a rollout")
        config = ctx.config or ArithWorkflowConfig(name="arith")
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        messages += [dict(m) for m in ctx.prompt]
        headers = {"Authorization": f"Bearer {rollout.api_key}"} if rollout.api_key else {}
        url = rollout.chat_completions_url.rstrip("/") + "/chat/completions"
        body = {"model": config.model, "messages": messages, "temperature": config.temperature}
        async with httpx.AsyncClient(timeout=config.request_timeout_sec) as client:
            response = await client.post(url, json=body, headers=headers)
            response.raise_for_status()
        data = response.json()
        reply = data["choices"][0]["message"]
        messages.append({"role": "assistant", "content": reply.get("content") or ""})
        if ctx.artifacts_dir is not None:
            # Publish the answer as an artifact too, so a task's own tests/test.sh
            # (which reads /logs/artifacts inside the container) can check it.
            answer = last_answer(messages)
            text = "" if answer is None else f"{answer:g}"
            (ctx.artifacts_dir / "answer.txt").write_text(text + "\n")
        usage = data.get("usage") or {}
        metrics = {k: float(v) for k, v in usage.items() if isinstance(v, int | float)}
        return AgentWorkflowOutput(messages=messages, metrics=metrics)


def last_answer(messages: Any) -> float | None:
    """The last number in the last assistant message, if any."""
    for message in reversed(list(messages)):
        if message.get("role") == "assistant":
            numbers = _NUMBER.findall(str(message.get("content") or ""))
            return float(numbers[-1]) if numbers else None
    return None


workflow_config = ArithWorkflowConfig(name="arith", model="arith-model")
