"""Rollouts through a ``serve --ray`` server with the osmosis-ai 0.3.8 client (tests only).

Runs inside the test cluster's network namespace, beside the server. Argument: a
JSON object ``{"url", "key", "rollouts": [{"metadata", "label", "prompt", "cancel_after"}],
"script"}``; prints one JSON line: the results, in order, what ``/health`` said, and the
Authorization headers the model endpoint saw. A fake chat endpoint (``tests.fake_chat``)
answers the workflows' model calls; with ``script`` (a list of replies) a
``tests.fake_chat.ScriptedChat`` does (for Harbor's agents).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any

import httpx
from osmosis_ai.rollout.client import RolloutClient

from tests.fake_chat import FakeChat, ScriptedChat


async def one(
    url: str, chat: FakeChat | ScriptedChat, key: str, spec: dict[str, Any], http: httpx.AsyncClient
) -> dict[str, Any]:
    client = RolloutClient(url=url, http_client=http)
    rollout_id = spec.get("rollout_id") or uuid.uuid4().hex
    started = time.monotonic()
    run = asyncio.create_task(
        client.run_rollout(
            initial_messages=spec.get("prompt", []),
            chat_completions_url=chat.base_url,
            rollout_id=rollout_id,
            llm_api_key=key,
            metadata=spec.get("metadata") or {},
            label=spec.get("label"),
        )
    )
    cancel_after = spec.get("cancel_after")
    cancelled_at = None
    if cancel_after is not None:
        await asyncio.sleep(float(cancel_after))
        cancelled_at = time.time()
        answer = await http.post(f"{url}/rollout/cancel", json={"ids": [rollout_id]})
        answer.raise_for_status()
    result = await run
    return {
        "rollout_id": rollout_id,
        "status": str(getattr(result.status, "value", result.status)),
        "reward": result.sample.reward if result.sample is not None else None,
        "err_category": str(getattr(result.err_category, "value", result.err_category)),
        "err_message": result.err_message,
        "seconds": round(time.monotonic() - started, 2),
        "cancelled_at": cancelled_at,
    }


async def main(spec: dict[str, Any]) -> None:
    url = spec["url"]
    script = spec.get("script")
    chat: FakeChat | ScriptedChat = ScriptedChat(script) if script else FakeChat()
    with chat:
        async with httpx.AsyncClient(timeout=300) as http:
            results = await asyncio.gather(
                *(one(url, chat, spec["key"], r, http) for r in spec["rollouts"])
            )
            health = (await http.get(f"{url}/health")).json()
            metrics = (await http.get(f"{url}/metrics")).text
    seen = [r.authorization for r in chat.requests]
    # The nodes' warm pools' gauges (the rest of /metrics is the server's own tests').
    warm = [line for line in metrics.splitlines() if line.startswith("harbor_exec_node_warm")]
    out = {"results": results, "health": health, "authorization": seen, "node_warm": warm}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
