"""Reward 1.0 when the last assistant message holds the label's number, else 0.0.

``metadata``: ``grader_raise`` (a ``RuntimeError``), ``no_reward`` (set none),
``remove`` (drop the sample from training).
"""

from __future__ import annotations

import re

from osmosis_ai.rollout import Grader, GraderConfig, GraderContext

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class SdkArithGraderConfig(GraderConfig):
    tolerance: float = 1e-6


class SdkArithGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        script = ctx.metadata or {}
        if script.get("grader_raise"):
            raise RuntimeError(str(script["grader_raise"]))
        if ctx.sample is None:
            raise ValueError("nothing to grade")
        if script.get("no_reward"):
            return
        numbers = _NUMBER.findall(str(ctx.sample.messages[-1].get("content") or ""))
        tolerance = getattr(self.config, "tolerance", 1e-6)
        right = bool(numbers) and abs(float(numbers[-1]) - float(ctx.label or "nan")) <= tolerance
        ctx.set_reward(1.0 if right else 0.0)
        ctx.sample.metrics["graded_by"] = "sdk"
        if script.get("remove"):
            ctx.sample.remove_sample = True


grader_config = SdkArithGraderConfig(name="sdk-arith-grader")
