"""Option panels whose names are never cut, whatever the terminal's width.

typer's own panel gives a flag's ``--no-`` form a column of its own and lets rich shrink
every column alike when the terminal is narrow, so at 80 columns a long pair such as
``--task-git-allow-unpinned/--no-task-git-allow-unpinned`` lost its ends. Here a flag's
names stand one above the other in one column that never wraps, and only the type and
help columns give way. ``install`` puts it in typer's place (argument panels keep typer's),
when help is first printed (``HelpCommand``, ``HelpGroup``): typer's help renderer and
the markdown it pulls in cost every command's start-up about 80 ms otherwise.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

rich_utils: Any = None  # typer.rich_utils, imported by install()
_typer_panel: Any = None
# What ``options_panel`` reads of typer's rich_utils (private: checked, never assumed).
_NEEDED = ("_print_options_panel", "_get_parameter_help", "highlighter", "negative_highlighter")


def _names(param: Any) -> Text:
    names = Text()
    longs = [name for name in param.opts if name.startswith("--")]
    negatives = [name for name in param.secondary_opts if name.startswith("--")]
    names.append_text(rich_utils.highlighter(", ".join(longs)))
    for negative in negatives:
        names.append("\n")
        names.append_text(rich_utils.negative_highlighter(negative))
    return names


def _shorts(param: Any) -> str:
    return ",".join(
        name for name in (*param.opts, *param.secondary_opts) if not name.startswith("--")
    )


def _types(param: Any, ctx: Any) -> Text:
    types = Text(style=rich_utils.STYLE_TYPES, overflow="fold")
    metavar = param.make_metavar(ctx=ctx)
    if metavar and "bool" not in metavar.lower():
        types.append(metavar)
    describe = getattr(param.type, "_describe_range", None)  # click's IntRange, FloatRange
    if callable(describe):
        described = describe()
        if described:
            types.append(rich_utils.RANGE_STRING.format(described))
    highlighted: Text = rich_utils.types_highlighter(types)
    return highlighted


def options_panel(
    *,
    name: str,
    params: list[TyperOption] | list[TyperArgument],
    ctx: Any,
    markup_mode: Any,
    console: Console,
) -> None:
    """One help panel: required mark, names, short names, type, help."""
    if not params or any(isinstance(param, TyperArgument) for param in params):
        assert _typer_panel is not None  # install() checked it
        _typer_panel(name=name, params=params, ctx=ctx, markup_mode=markup_mode, console=console)
        return
    table = Table(
        highlight=True,
        show_header=False,
        expand=True,
        box=None,
        pad_edge=rich_utils.STYLE_OPTIONS_TABLE_PAD_EDGE,
        padding=rich_utils.STYLE_OPTIONS_TABLE_PADDING,
    )
    required = any(param.required for param in params)
    if required:
        table.add_column(no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column()
    table.add_column(ratio=1)
    try:
        rows = [_row(param, ctx, markup_mode, required) for param in params]
    except (AttributeError, TypeError):
        # A typer whose internals moved (they are private): its own panel, never a crash.
        assert _typer_panel is not None  # install() checked it
        _typer_panel(name=name, params=params, ctx=ctx, markup_mode=markup_mode, console=console)
        return
    for row in rows:
        table.add_row(*row)
    console.print(
        Panel(
            table,
            border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER,
            title=name,
            title_align=rich_utils.ALIGN_OPTIONS_PANEL,
        )
    )


def _row(param: Any, ctx: Any, markup_mode: Any, required: bool) -> list[Any]:
    row: list[Any] = [
        _names(param),
        _shorts(param),
        _types(param, ctx),
        rich_utils._get_parameter_help(param=param, ctx=ctx, markup_mode=markup_mode),
    ]
    if required:
        mark = rich_utils.REQUIRED_SHORT_STRING if param.required else ""
        row.insert(0, Text(mark, style=rich_utils.STYLE_REQUIRED_SHORT))
    return row


def install() -> None:
    """Make typer print option panels with ``options_panel``, where this typer has the
    internals it replaces (else typer's own panels stay: help still works, names may wrap)."""
    global rich_utils, _typer_panel
    if rich_utils is not None:
        return
    import typer.rich_utils as typer_rich_utils

    module: ModuleType = typer_rich_utils
    _typer_panel = getattr(module, "_print_options_panel", None)
    rich_utils = module
    if all(hasattr(module, name) for name in _NEEDED):
        setattr(module, "_print_options_panel", options_panel)  # noqa: B010 (private)


class HelpCommand(TyperCommand):
    """A command whose help has ``options_panel``'s panels."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        install()
        super().format_help(ctx, formatter)


class HelpGroup(TyperGroup):
    """A group whose help has ``options_panel``'s panels."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        install()
        super().format_help(ctx, formatter)
