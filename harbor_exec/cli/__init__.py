"""Command-line entry point: ``harbor-exec``.

Each command lives in its own module and registers itself on the shared app.
"""

from harbor_exec.cli.app import app


def main() -> None:
    # Imported here so that ``import harbor_exec.cli`` stays cheap.
    from harbor_exec.cli import commands  # noqa: F401

    app()


__all__ = ["app", "main"]
