"""What runs inside task containers: the runner, the exchange files, the redactor.

Standard library and pydantic only (plus ``harbor_exec.authoring`` and
``harbor_exec.protocol``): these modules ship in harbor-exec's container runtime,
which knows nothing of the service (``bundler/runtime.py`` checks the imports).
"""
