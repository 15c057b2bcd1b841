"""One trial, in Harbor's order: a task (``task``), its environment, an agent
(``harbor_exec.agents``, over the trial's ``session``), a verifier (``verifiers``), the
artifacts and ``result.json`` (``results``), over any ``ContainerRuntime`` (``trial``)."""
