"""The package cache (docs/package-cache.md): its store and fills (``cache``), its
server behind a trial's egress proxy (``serve``), the live service (``service``), a
trial's session (``session``), the local CA and trust files (``ca``, ``trust``,
``build_trust``) and the build gateway an image build reaches it through
(``build_gateway``, ``build_route``)."""
