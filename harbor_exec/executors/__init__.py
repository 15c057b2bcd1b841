"""Where trials run: the ``TrialExecutor`` seam and its travelling values (``base``),
local threads (``local``), the nodes of a Ray cluster (``ray``), and the model relay
that lends a rollout its model endpoint (``relay``)."""
