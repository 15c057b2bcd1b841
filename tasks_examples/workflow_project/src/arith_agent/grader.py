"""The grader of ``arith_agent.workflow``, and its config.

It lives in a module of its own that the workflow does not import: the bundle's
agent part (what the workflow's container gets) leaves this module out, so the
workflow can never read the grader's config. The grader may import the workflow's
helpers (``last_answer``).
"""

from __future__ import annotations

import math

from harbor_exec.authoring import Grader, GraderConfig, GraderContext

from arith_agent.workflow import last_answer


class ArithGraderConfig(GraderConfig):
    # A reply with no number at all teaches nothing: drop it from training.
    drop_unanswered: bool = True
    tolerance: float = 1e-6


class ArithGrader(Grader):
    """Reward 1.0 when the answer equals the label, else 0.0."""

    async def grade(self, ctx: GraderContext) -> None:
        if ctx.sample is None:
            raise ValueError("no sample to grade")
        config = self.config if isinstance(self.config, ArithGraderConfig) else ArithGraderConfig(
            name="arith-grader"
        )
        answer = last_answer(ctx.sample.messages)
        if answer is None and config.drop_unanswered:
            ctx.sample.remove_sample = True
            ctx.sample.metrics["unanswered"] = 1.0
            ctx.set_reward(0.0)
            return
        expected = float(ctx.label) if ctx.label is not None else math.nan
        correct = answer is not None and math.isclose(
            answer, expected, rel_tol=0.0, abs_tol=config.tolerance
        )
        ctx.set_reward(1.0 if correct else 0.0)


grader_config = ArithGraderConfig(name="arith-grader")
