"""The ``harbor-exec`` typer application; command modules register on it."""

import typer

app = typer.Typer(
    name="harbor-exec",
    help="Run Harbor tasks as isolated Docker trials: serve rollouts, prewarm, validate.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
