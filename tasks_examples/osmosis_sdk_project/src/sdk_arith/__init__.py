"""An arithmetic agent and its grader, written against osmosis-ai 0.3.8 only."""
