"""How `--help` reads: flags without a type, arguments in capitals, option values named by meaning.

Typer 0.29 (pinned in pyproject.toml: its help layout changes between releases) prints `<bool>`
beside every flag, `<int>`/`<str>` beside options and `{input}` for a required argument. pagecli's
help follows the usual convention instead: `--progress` takes no value and shows none, an option
shows its metavar (FILE, GIB, N) where one is declared and the value's kind otherwise, and the usage
line reads `pagecli generate [OPTIONS] INPUT`. `tidy(command)` applies that to a command tree (and keeps
an unused `--help` from costing a pydantic import).
"""

from __future__ import annotations

from typing import Any

from typer import _click
from typer.core import TyperArgument, TyperGroup, TyperOption

_KIND_NAMES = {int: "N", float: "NUMBER", str: "TEXT"}


class PlainArgument(TyperArgument):
    """An argument named in capitals, without braces or a type beside it."""

    def display_type_rich(self, ctx: _click.Context) -> str | None:
        return None

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        name = name if self.required else f"[{name}]"
        return name if self.nargs == 1 else f"{name}..."


class PlainOption(TyperOption):
    """A flag shows no type; an option shows its metavar, else the kind of value it takes."""

    def display_type_rich(self, ctx: _click.Context) -> str | None:
        if self.is_flag or self.is_bool_flag or self.count:
            return None
        if self.metavar:
            return self.metavar
        return _KIND_NAMES.get(self.type_descriptor.annotation, "VALUE")


def tidy(command: Any) -> Any:
    """Give every parameter of `command` and its subcommands the plain help style; returns it."""
    for param in command.params:
        _restyle(param)
    help_option = command.get_help_option(_click.Context(command, help_option_names=["-h", "--help"]))
    if help_option is not None:
        _restyle(help_option)
        # Typer 0.29 leaves the flag's default None, and coerces None through a pydantic TypeAdapter: the
        # first command that is not asked for help would import pydantic for it (about 0.1 s).
        help_option.default = False
    if isinstance(command, TyperGroup):
        for sub in command.commands.values():
            tidy(sub)
    return command


def _restyle(param: Any) -> None:
    if isinstance(param, TyperArgument):
        if param.metavar is None:
            param.metavar = param.name.upper()
        param.__class__ = PlainArgument
    elif isinstance(param, TyperOption):
        param.__class__ = PlainOption
