"""Host-side egress for ``network_mode = "allowlist"`` trials: a per-trial HTTP forward
proxy on a unix socket (``proxy``), Harbor's host policy (``policy``), the container's
side of it (``container``) and a trial's per-phase plan (``plan``).

Nothing is re-exported: ``policy`` is imported by the task format, which must not load
the proxy's h11 and httpcore."""
