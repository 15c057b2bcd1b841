"""``python -m harbor_exec.cli``: the same as the ``harbor-exec`` command."""

from harbor_exec.cli import main

main()
