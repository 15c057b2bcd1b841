"""An arithmetic agent (OpenAI Agents SDK, via osmosis-ai's integration) and its grader."""
