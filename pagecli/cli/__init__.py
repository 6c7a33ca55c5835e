"""The `pagecli` command: Typer app, error handling and exit codes.

Every failure a user can cause ends with one red line and a non-zero exit code;
`--debug` (or PAGECLI_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated, Optional

import typer

from pagecli import __version__
from pagecli.cli import help_style
from pagecli.cli.app import app
from pagecli.cli import options as o
from pagecli.errors import PagecliError
from pagecli.native import isa
from pagecli.ui.progress import error_line



def _version(value: bool) -> None:
    if value:
        typer.echo(f"pagecli {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    # A plain bool (not Optional): typer coerces a None default through pydantic, 0.1 s on every command.
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """With no command, starts `pagecli chat` with the default model."""
    if ctx.invoked_subcommand is None:
        from pagecli.cli.chat import chat

        ctx.invoke(chat)


@app.command()
@o.engine_flags
@o.ray_flags
def generate(
    input: Annotated[str, typer.Argument(
        metavar="INPUT", show_default=False,
        help="JSONL (prompt/messages, or OpenAI batch lines) or text, one prompt per line; '-' reads stdin.")],
    output: Annotated[str, typer.Option(
        "--output", "-o", metavar="OUTPUT", help="JSONL results, one per input line, in input order; re-running "
                                                 "resumes; '-' writes stdout.")],
    flags: o.RunFlags,
    ray: o.RayFlags,
    format: Annotated[str, typer.Option("--format", metavar="FORMAT", help="auto|jsonl|text.")] = "auto",
    progress: Annotated[Optional[bool], typer.Option(
        "--progress/--no-progress", help="Progress bar (default: on a terminal).", show_default=False)] = None,
    retry_errors: Annotated[bool, typer.Option(
        "--retry-errors", help="Run again the lines whose result is an error (after raising a limit, say).")] = False,
    force_restart: Annotated[bool, typer.Option(
        "--force-restart", help="Run every line again, emptying OUTPUT first (a pagecli results file only): the "
                                "way on when OUTPUT answers another input or other settings.")] = False,
    server: Annotated[Optional[str], typer.Option(
        "--server", metavar="URL", help="Send the lines to a running `pagecli serve` at URL instead of loading a "
                                        "model here (its engine flags apply; sampling flags and the lines' own "
                                        "fields are sent).")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", metavar="KEY", envvar="PAGECLI_API_KEY", help="The server's --api-key (with --server).")] = None,
    local: Annotated[bool, typer.Option(
        "--local", help="Load the model in this process even when a `pagecli serve --keep-alive` of the same model "
                        "runs (by default such a server answers the lines).")] = False,
    max_line_bytes: Annotated[int, typer.Option(
        "--max-line-bytes", min=1, metavar="BYTES",
        help="Longest input line read (in UTF-8 bytes); a longer one stops the run before anything runs.")]
    = 4 << 20,  # input_lines.DEFAULT_MAX_LINE_BYTES, written out so this module imports nothing more
    keep_alive: o.KeepAliveStartOpt = None,
) -> None:
    """Generate completions for every request in INPUT and write them to OUTPUT."""
    if format not in ("auto", "jsonl", "text"):
        raise PagecliError(f"--format must be auto, jsonl or text (got '{format}').")
    from pagecli.cli.generate import run_generate

    cluster = _cluster_options(ray)
    if server is not None and cluster is not None:
        raise PagecliError("--server sends the lines to one running server; leave out --ray.")
    if server is not None and local:
        raise PagecliError("--server sends the lines to a running server and --local loads the model here; pass one.")
    o.refuse_keep_alive_with(keep_alive, server, local, ray=cluster is not None)
    settings = flags.settings()
    found = None
    if server is None and cluster is None and not local:
        from pagecli.cli.running_server import running_or_started

        found = running_or_started(settings, flags.as_args(settings.model), keep_alive, api_key)
    if server is None and found is None and api_key is not None:
        raise PagecliError("--api-key is the key of a server: pass it with --server URL.")
    code = run_generate(settings, input, output, format, progress, retry_errors=retry_errors,
                        cluster=cluster, force_restart=force_restart, max_line_bytes=max_line_bytes,
                        server=None if server is None else (server, api_key), found=found, found_key=api_key)
    if code:
        raise typer.Exit(code)


def _cluster_options(ray: o.RayFlags) -> object:
    """generate's Ray options (pagecli.cluster.launch.ClusterOptions), or None without --ray."""
    fields = ray.cluster_fields()
    if fields is None:
        return None
    from pagecli.cluster import require_ray

    require_ray()
    from pagecli.cluster.launch import ClusterOptions

    return ClusterOptions(**fields)


@app.command()
def profiles() -> None:
    """List the built-in profiles and what they set."""
    from pagecli.config import available_profiles, load_profile

    for path in available_profiles():
        profile = load_profile(str(path))
        typer.echo(f"{path.stem:12} {profile.description}")


def _register_optional_commands() -> None:
    """Commands that live in their own modules (each registers on `app`)."""
    import importlib

    for module in ("pagecli.cli.models_cmd", "pagecli.cli.chat", "pagecli.cli.bench", "pagecli.cli.cache_cmd",
                   "pagecli.cli.serve", "pagecli.cli.doctor"):
        importlib.import_module(module)


# Typer 0.29 (pinned) carries its own copy of click, whose exceptions are typer's classes; click itself
# is not imported (20 ms of every start).
_EXITS = (typer.Exit,)
_USAGE_ERRORS = (typer.TyperException,)
_ABORTS = (typer.Abort, KeyboardInterrupt)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("PAGECLI_DEBUG") == "1"
    isa.limit_libraries()
    _register_optional_commands()
    try:
        command = help_style.tidy(typer.main.get_command(app))
        result = command.main(args=args, prog_name="pagecli", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except PagecliError as exc:
        if debug:
            traceback.print_exc()
        error_line(str(exc))
        return exc.exit_code
    except _EXITS as exc:
        return exc.exit_code
    except _USAGE_ERRORS as exc:
        if hasattr(exc, "show"):
            exc.show()
        else:
            error_line(str(exc))
        return exc.exit_code
    except _ABORTS:
        error_line("Interrupted.")
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one sentence, not a traceback
        if debug:
            traceback.print_exc()
        error_line(f"Unexpected {type(exc).__name__}: {exc}. Re-run with --debug for details; please report it.")
        return 1
