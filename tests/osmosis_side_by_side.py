"""What the osmosis-ai SDK side-by-side tests share: one rollout through osmosis-ai
0.3.8's real RolloutClient, the result fields the backends must agree on, and the
template task without tests/ (the bundled SDK grader verifies). Imported only by
modules that skip below Python 3.12, where osmosis-ai is installed."""

from __future__ import annotations

import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

from tests.bundle_utils import REPO_ROOT

TEMPLATE = REPO_ROOT / "tasks_examples" / "template"


async def run_osmosis_rollout(
    url: str,
    chat_url: str,
    rollout_id: str,
    prompt: list[dict[str, Any]],
    *,
    admission_timeout_sec: float = 30,
    timeout_sec: float = 60,
    **options: Any,
) -> Any:
    """One rollout of ``prompt`` at ``url`` by osmosis-ai's client (``options``: its
    ``run_rollout`` keywords, e.g. ``llm_api_key``, ``label``, ``metadata``, ``grade``)."""
    from osmosis_ai.rollout.client import RolloutClient

    client = RolloutClient(url=url, admission_timeout_sec=admission_timeout_sec)
    try:
        return await client.run_rollout(
            prompt,
            chat_url,
            rollout_id,
            agent_timeout_sec=timeout_sec,
            grader_timeout_sec=timeout_sec,
            **options,
        )
    finally:
        await client.aclose()


def comparable(result: Any, *, exclude: Collection[str] = ()) -> dict[str, Any]:
    """The fields of a result two backends must agree on (the sample less ``exclude``)."""
    sample = result.sample
    return {
        "status": result.status.value,
        "err_message": result.err_message,
        "err_category": result.err_category.value if result.err_category else None,
        "sample": None if sample is None else sample.model_dump(mode="json", exclude=set(exclude)),
    }


def template_without_tests(root: Path) -> Path:
    """The template task without tests/: the bundled SDK grader verifies."""
    task = root / "template"
    shutil.copytree(TEMPLATE, task)
    shutil.rmtree(task / "tests")
    return task
