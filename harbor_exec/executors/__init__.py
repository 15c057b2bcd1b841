"""Where trials run: the ``TrialExecutor`` seam (``base``) and what a trial is as it
travels (``spec``: a picklable ``TrialSpec`` plus its ``TrialSecrets``), local
threads (``local``) and the nodes of a Ray cluster (``ray``), each opening a rollout's
model relay (``harbor_exec.network.relay``) beside its trial; ``native``: the trials of Harbor's own
agents (their config, endpoint and secrets), for the backend and ``harbor-exec run``."""
