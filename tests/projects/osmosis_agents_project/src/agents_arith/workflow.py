"""An OpenAI Agents SDK agent with an ``add`` tool, run the osmosis-ai way.

``OsmosisAgent`` swaps the ``OsmosisRolloutModel`` placeholder for a litellm model
bound to the rollout's chat endpoint; ``OsmosisMemorySession`` records the
conversation and is the rollout's sample source (the workflow returns None).

``metadata`` variants: ``raise`` (a ``RuntimeError`` before the agent runs),
``max_turns`` (the runner's turn limit: 1 makes the SDK raise ``MaxTurnsExceeded``),
``no_session`` (run without the session: the integration refuses the model call).
"""

from __future__ import annotations

from agents import ModelSettings, Runner, function_tool
from osmosis_ai.rollout import AgentWorkflow, AgentWorkflowConfig, AgentWorkflowContext
from osmosis_ai.rollout.integrations.agents.openai_agents import (
    OsmosisAgent,
    OsmosisMemorySession,
    OsmosisRolloutModel,
)

INSTRUCTIONS = "You are a calculator. Use the add tool, then reply with the number only."


@function_tool
def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


class AgentsArithConfig(AgentWorkflowConfig):
    temperature: float = 0.0
    max_turns: int = 4


class AgentsArithWorkflow(AgentWorkflow[AgentsArithConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentsArithConfig]) -> None:
        script = ctx.metadata or {}
        if script.get("raise"):
            raise RuntimeError(str(script["raise"]))
        config = ctx.config or AgentsArithConfig(name="agents-arith")
        session = None if script.get("no_session") else OsmosisMemorySession()
        agent = OsmosisAgent(
            name="calculator",
            instructions=INSTRUCTIONS,
            model=OsmosisRolloutModel(),
            model_settings=ModelSettings(temperature=config.temperature),
            tools=[add],
        )
        question = str(ctx.prompt[-1]["content"])
        max_turns = int(script.get("max_turns", config.max_turns))
        await Runner.run(agent, question, session=session, max_turns=max_turns)
        # The session holds the conversation: it is the sample.
        return None


workflow_config = AgentsArithConfig(name="agents-arith", max_turns=3)
