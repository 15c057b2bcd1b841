"""Agents: one home per agent kind (Harbor's ``agents/``).

* ``base.py``: the interface. ``AgentSpec`` (an agent kind as plain data in a
  ``TrialSpec``: what it mounts, what it needs prepared, the runnable agent of one
  trial), ``Agent`` (what a trial drives), ``AgentSession`` (the started container as
  agents see it), ``AgentRun``, ``AgentInfo``.
* ``oracle.py``: Harbor's ``oracle`` (the task's ``solution/solve.sh``).
* ``workflow.py``: a bundled ``AgentWorkflow``, run by the container-side runner.
* ``native/``: Harbor's own agents (terminus-2, mini-swe-agent, opencode), run
  unchanged: ``config.py`` (names, checks, ``NativeAgentConfig``), ``agent.py`` (the
  spec and the agent), ``environment.py`` (Harbor's ``BaseEnvironment`` over the
  trial's session, and the driver), ``layer.py`` (an in-container agent's prebuilt,
  read-only layer and its install).

A new agent kind is one module or folder here; executors and specs ask only
``AgentSpec``. This part imports nothing above it (no trial engine, no executor).
"""
