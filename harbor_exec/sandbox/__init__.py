"""The container seam and its Docker implementation.

``runtime`` defines what a trial asks of a container engine (``ContainerRuntime``)
and what the service asks of it as an administrator (``EngineAdmin``); ``archives``
moves files in and out as tar streams under budgets; ``docker`` is the one module
that imports the Docker SDK; ``buildkit``, ``cgroups``, ``images`` and ``deps``
serve it (build progress, host-side process kills, base images, the bundle's
dependency layer).
"""
