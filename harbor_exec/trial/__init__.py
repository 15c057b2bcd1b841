"""One trial, in Harbor's order: a task (``task``), its environment, an agent
(``agents``), a verifier, the artifacts and ``result.json`` (``results``), over any
``ContainerRuntime`` (``trial``)."""
