"""Where tasks come from besides the served directories: git repositories (``git``)."""
