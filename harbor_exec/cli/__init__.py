"""Command-line entry point: ``harbor-exec``.

Each command lives in its own module; ``app.py`` registers them on the app by name,
and ``import harbor_exec.cli`` loads none of them until ``main`` (or ``app``) is asked for.
"""

from typing import Any


def main() -> None:
    from harbor_exec.cli.app import app

    app()


def __getattr__(name: str) -> Any:
    if name == "app":
        from harbor_exec.cli.app import app

        return app
    raise AttributeError(name)


__all__ = ["app", "main"]
