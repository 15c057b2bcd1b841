"""The Harbor task format (Harbor 0.26's ``harbor.models.task``), nothing else.

``config``: ``task.toml`` as pydantic, with Harbor's defaults, deprecated keys and
messages; ``hosts``: Harbor's ``allowed_hosts`` entry forms; ``snapshots``: a task
directory checked and copied, content-addressed, into the cache; ``task``: a loaded
``Task`` and its steps; ``discovery``: which directories of a dataset are tasks.

Nothing here loads a network stack: the trial, the agents and the host's network
services read the task format, never the other way round.
"""
