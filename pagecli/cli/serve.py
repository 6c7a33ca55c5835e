"""`pagecli serve`: the HTTP server (OpenAI's, Anthropic's and Ollama's APIs, a web page) on one engine, with the
pool view on a terminal."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from pagecli.cli.app import app
from pagecli.cli import options as o
from pagecli.errors import PagecliError

ModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False, help="Local HF folder, hub id or .gguf file (same as --model).")]
HostOpt = Annotated[str, typer.Option("--host", help="Address to listen on; 0.0.0.0 listens on every interface.")]
PortOpt = Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", envvar="PAGECLI_API_KEY", show_default=False,
    help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on API requests (or set PAGECLI_API_KEY).")]
MaxPendingOpt = Annotated[int, typer.Option(
    "--max-pending", metavar="N", help="Most sequences queued or running at once; more are answered 429.")]
GraceOpt = Annotated[float, typer.Option(
    "--grace", metavar="SECONDS", help="On SIGTERM or Ctrl-C, how long running requests may finish.")]
ScreenOpt = Annotated[Optional[bool], typer.Option(
    "--screen/--no-screen", show_default=False,
    help="Live pool panel and request table (default: when stdout is a terminal; else one log line a request).")]
ReasoningOpt = Annotated[str, typer.Option(
    "--reasoning-format", metavar="none|separate",
    help="separate: a reply's <think>...</think> comes back as reasoning_content; none: left in content.")]
KeepAliveOpt = Annotated[Optional[str], typer.Option(
    "--keep-alive", metavar="DURATION", show_default=False,
    help="Stop DURATION (30s, 5m, 1h30m; 0: at once) after the last request, and meanwhile let `pagecli chat` and "
         "`pagecli generate` of the same model use this server instead of loading it (default: serve until "
         "stopped, unlisted).")]
REASONING_FORMATS = ("none", "separate")


@app.command()
@o.engine_flags
def serve(
    model_arg: ModelArg = None, flags: o.RunFlags = None,  # type: ignore[assignment] - filled by engine_flags
    host: HostOpt = "127.0.0.1", port: PortOpt = 8000, api_key: ApiKeyOpt = None,
    max_pending: MaxPendingOpt = 256, grace: GraceOpt = 30.0, screen: ScreenOpt = None,
    reasoning_format: ReasoningOpt = "separate", keep_alive: KeepAliveOpt = None,
) -> None:
    """Serve the model over OpenAI's APIs (/v1/chat/completions, /v1/completions, /v1/responses), Anthropic's
    (/v1/messages) and Ollama's (/api/*), with a chat page and the live block pool at /."""
    from pagecli.serve.keep_alive import parse_duration
    from pagecli.serve.startup import ServeOptions, run_server

    if model_arg and flags.model and model_arg != flags.model:
        raise PagecliError(f"Two models given ('{model_arg}' and --model '{flags.model}'); pass one.")
    if not 0 <= port <= 65535:
        raise PagecliError(f"--port must be from 0 to 65535 (got {port}).")
    if max_pending < 1:
        raise PagecliError(f"--max-pending must be at least 1 (got {max_pending}).")
    if grace < 0:
        raise PagecliError(f"--grace must be 0 or more seconds (got {grace:g}).")
    if reasoning_format not in REASONING_FORMATS:
        raise PagecliError(f"--reasoning-format must be none or separate (got '{reasoning_format}').")
    keep_alive_s = None if keep_alive is None else parse_duration(keep_alive)
    settings = flags.settings(model=model_arg)
    if getattr(settings.sampling, "n", 1) > 1:
        raise PagecliError(f"`pagecli serve` takes n per request (the request's 'n' field), not n "
                           f"{settings.sampling.n} for all; drop --n or set n = 1 in the profile.")
    if settings.sampling.beam_search:
        raise PagecliError("`pagecli serve` does not run beam search; drop --beam-width or set beam_width = 1 "
                           "in the profile.")
    if settings.sampling.structured is not None:
        raise PagecliError("`pagecli serve` takes a JSON schema per request (its 'response_format'), not "
                           "--json-schema for all; drop --json-schema.")
    options = ServeOptions(host, port, api_key or None, max_pending, grace, screen, reasoning_format, keep_alive_s)
    code = run_server(settings, options)
    if code:
        raise typer.Exit(code)
