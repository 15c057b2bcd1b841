"""The ``harbor-exec`` typer application, every command registered here by name."""

import typer

from harbor_exec.cli.bundle import bundle
from harbor_exec.cli.help import HelpCommand, HelpGroup
from harbor_exec.cli.images import images_app
from harbor_exec.cli.init import init_app
from harbor_exec.cli.prewarm import prewarm
from harbor_exec.cli.run import run
from harbor_exec.cli.serve import serve
from harbor_exec.cli.validate import validate

app = typer.Typer(
    name="harbor-exec",
    cls=HelpGroup,  # option names whole at any width (cli/help.py)
    help="Run Harbor tasks as isolated Docker trials: serve rollouts, prewarm, validate.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.command(cls=HelpCommand)(validate)
app.command(cls=HelpCommand)(prewarm)
app.command(cls=HelpCommand)(run)
app.add_typer(images_app, name="images")
app.add_typer(init_app, name="init")
app.command(cls=HelpCommand)(bundle)
app.command(cls=HelpCommand)(serve)
