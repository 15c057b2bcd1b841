"""One trial, in Harbor's order: a task (``harbor_exec.tasks``), its environment, an agent
(``harbor_exec.agents``, over the trial's ``session``), a verifier (``verifiers``), the
artifacts (``artifacts``) and ``result.json`` (``results``), over any ``ContainerRuntime``
(``trial``); a multi-step task's trial is its subclass (``steps``), ``factory`` picks the
class; what a trial is (``spec``) and the sandbox policy it runs under (``policy``)."""
