"""Harbor's own agents (terminus-2, mini-swe-agent, opencode) as trial agents, run unchanged.

See ``agent.py`` for how each reaches the model and what its sample is. Nothing here
imports Harbor at import time: ``environment.py`` (the ``native`` extra) is imported
only when a native agent runs.
"""
