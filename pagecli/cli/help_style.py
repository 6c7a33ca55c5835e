"""How `--help` reads: flags without a type, arguments in capitals, option values named by meaning.

Typer 0.29 (pinned in pyproject.toml: its help layout changes between releases) prints `<bool>`
beside every flag, `<int>`/`<str>` beside options and `{input}` for a required argument. pagecli's
help follows the usual convention instead: `--progress` takes no value and shows none, an option
shows its metavar (FILE, GIB, N) where one is declared and the value's kind otherwise, and the usage
line reads `pagecli generate [OPTIONS] INPUT`. `tidy(command)` applies that to a command tree (and keeps
an unused `--help` from costing a pydantic import).

`--help` is written as plain text, the options in sections by their panel (Options, Engine, Sampling, ...), not
through typer's rich layout: importing typer's rich help (markdown parsing, rich tracebacks) and drawing its
boxed tables took 0.1-0.2 s of a 0.3-0.4 s `pagecli generate --help` (issue 48's 0.3 s target), and the boxes
squeezed each option's text into a third of an 80-column terminal. Usage errors keep typer's rich panel.

Typer 0.29 also coerces every value that is not a flag's bool, None and the defaults included, through a pydantic
TypeAdapter built per parameter: 0.15-0.3 s of every command that runs (importing pydantic, building ~40
adapters), the first-token time of `chat` against a server included. A plain str, int, float or bool parameter
takes a value already of its type, or a plain numeral, within its bounds, as it is here (the value pydantic
gives); anything else (out of bounds, a list, a spelling such as "1_000" or " 5") still goes to typer's
adapter, so its refusals are typer's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from typer import _click
from typer._coercion import RuntimeParam, TypeDescriptor, build_runtime_param
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

_KIND_NAMES = {int: "N", float: "NUMBER", str: "TEXT"}


_NUMERALS = {int: re.compile(r"-?\d+"), float: re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")}


@dataclass(frozen=True)
class _PlainValue(RuntimeParam):
    """A str, int, float or bool parameter's value (or a repeated str option's values) as it is, else typer's own
    coercion (module docstring)."""

    descriptor: TypeDescriptor | None = None

    def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
        kind = self.annotation
        if kind == list[str]:
            if isinstance(value, (list, tuple)) and all(type(item) is str for item in value):
                return list(value)
            return self._typers(value, param, ctx)
        if type(value) is kind:
            return value if kind is bool else self._within_bounds(value, param, ctx)
        if kind is float and type(value) is int:
            return self._within_bounds(float(value), param, ctx)
        numeral = _NUMERALS.get(kind)  # type: ignore[call-overload]
        if numeral is not None and isinstance(value, str) and numeral.fullmatch(value):
            return self._within_bounds(kind(value), param, ctx)  # type: ignore[operator]
        return self._typers(value, param, ctx)

    def _within_bounds(self, value: Any, param: Any, ctx: Any) -> Any:
        info = self.parameter_info
        if (info.min is None or value >= info.min) and (info.max is None or value <= info.max):
            return value
        return self._typers(value, param, ctx)  # its refusal, in its words

    def _typers(self, value: Any, param: Any, ctx: Any) -> Any:
        return build_runtime_param(self.descriptor)._coerce_value(value, param=param, ctx=ctx)  # type: ignore[arg-type]


def _plain_value(param: Any) -> RuntimeParam | None:
    descriptor = param.type_descriptor
    info = descriptor.parameter_info
    kind = descriptor.annotation
    simple = (descriptor.file_annotation is None and info.parser is None and not info.clamp and param.nargs == 1
              and (kind in (str, int, float, bool) and not param.multiple or kind == list[str] and param.multiple))
    return _PlainValue(info, descriptor.annotation, descriptor) if simple else None


class PlainArgument(TyperArgument):
    """An argument named in capitals, without braces or a type beside it."""

    def display_type_rich(self, ctx: _click.Context) -> str | None:
        return None

    def get_runtime_param(self) -> RuntimeParam:
        if self._runtime_param is None:
            self._runtime_param = _plain_value(self)
        return super().get_runtime_param()

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

    def get_runtime_param(self) -> RuntimeParam:
        if self._runtime_param is None:
            self._runtime_param = _plain_value(self)
        return super().get_runtime_param()


# Sections in this order; any other panel (Ray cluster, ...) follows in the order its first option comes.
_SECTIONS = ("Arguments", "Options", "Engine", "Sampling")


def _options_by_panel(command: Any, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
    sections: dict[str, list[tuple[str, str]]] = {name: [] for name in _SECTIONS}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        if param.param_type_name == "argument":
            sections["Arguments"].append(record)
        else:
            sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
    for name, rows in sections.items():
        if rows:
            with formatter.section(name):
                formatter.write_dl(rows)


class PlainHelpCommand(TyperCommand):
    """A command whose `--help` is plain text in sections by panel (module docstring)."""

    def format_help(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        _click.Command.format_help(self, ctx, formatter)

    def format_options(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        _options_by_panel(self, ctx, formatter)


class PlainHelpGroup(TyperGroup):
    """A group whose `--help` is plain text: its options by panel, then its commands."""

    def format_help(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        _click.Command.format_help(self, ctx, formatter)

    def format_options(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        _options_by_panel(self, ctx, formatter)
        self.format_commands(ctx, formatter)

    def format_commands(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        # Each command's first sentence whole (typer's plain layout cuts it at the line's end with "...").
        rows = [(name, command.get_short_help_str(limit=1_000)) for name in self.list_commands(ctx)
                if (command := self.get_command(ctx, name)) is not None and not command.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


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
        command.__class__ = PlainHelpGroup
        for sub in command.commands.values():
            tidy(sub)
    elif isinstance(command, TyperCommand):
        command.__class__ = PlainHelpCommand
    return command


def _restyle(param: Any) -> None:
    if isinstance(param, TyperArgument):
        if param.metavar is None:
            param.metavar = param.name.upper()
        param.__class__ = PlainArgument
    elif isinstance(param, TyperOption):
        param.__class__ = PlainOption
