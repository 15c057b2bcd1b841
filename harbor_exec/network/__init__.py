"""Everything a container dials on the host: the model relay (``relay``), the egress
proxy and its allowlist (``egress``), the package cache, its CA and the build gateway
(``packages``), on one small HTTP/1.1 server core (``http11``).

Nothing is re-exported here: importing a light module (the allowlist's policy, the
usage a relay counts) must not load h11 or httpcore.
"""
