"""Dataset jobs: ``validate``/``run`` over many tasks (``dataset``) and image
prewarming (``prewarm``), with progress and Harbor's job ``result.json``."""
