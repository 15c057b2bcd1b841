"""Where trials run: the ``TrialExecutor`` seam (``base``) and what a trial is as it
travels (``spec``: a picklable ``TrialSpec`` plus its ``TrialSecrets``), local
threads (``local``), the nodes of a Ray cluster (``ray``), and the model relay that
lends a rollout its model endpoint (``relay``); ``native``: the trials of Harbor's own
agents (their config, endpoint and secrets), for the backend and ``harbor-exec run``."""
