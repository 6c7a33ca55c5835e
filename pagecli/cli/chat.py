"""`pagecli chat`: multi-turn chat with streaming replies, prefix reuse across turns and a live
block-pool panel on a terminal; plain text or JSONL lines when stdin/stdout is not a terminal.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, TextIO

import typer

from pagecli.cli.app import app
from pagecli.cli import options as o
from pagecli.errors import PagecliError

if TYPE_CHECKING:
    from pagecli.chat.view import ChatOptions
    from pagecli.chat.conversation import Conversation
    from pagecli.chat.session import SessionListing
    from pagecli.chat.session_lock import SessionLock
    from pagecli.engine import Engine
    from pagecli.serve.registry import ServerEntry as RunningServer

_DEFAULT_MODEL_LABEL = "SmolLM2-135M-Instruct (embedded)"

ModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False, help="Local HF folder, hub id or .gguf file (same as --model).")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]
SessionOpt = Annotated[Optional[str], typer.Option(
    "--session", help="Start a session saved under NAME after every turn.", metavar="NAME")]
ResumeOpt = Annotated[Optional[str], typer.Option(
    "--resume", help="Continue the saved session NAME (and keep saving it).", metavar="NAME")]
ListSessionsOpt = Annotated[bool, typer.Option("--list-sessions", help="List saved sessions and exit.")]
InputOpt = Annotated[Optional[str], typer.Option(
    "--input", "-i", help="Read user messages from FILE, one per line (plain mode).", metavar="FILE")]
JsonlOpt = Annotated[bool, typer.Option(
    "--jsonl", help="Plain mode writing one JSON record per turn: reply and the turn's stats.")]
NoTruncateOpt = Annotated[bool, typer.Option(
    "--no-truncate", help="When the conversation outgrows max_model_len, refuse the message instead of "
                          "dropping the oldest turns.")]
ServerOpt = Annotated[Optional[str], typer.Option(
    "--server", metavar="URL", help="Chat through a running `pagecli serve` at URL (e.g. http://127.0.0.1:8000): no "
                                    "model loads here; replies stream from the server and the pool panel shows its "
                                    "pool. Engine flags are the server's; sampling flags apply.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", metavar="KEY", envvar="PAGECLI_API_KEY", help="The server's --api-key (with --server).")]
LocalOpt = Annotated[bool, typer.Option(
    "--local", help="Load the model in this process even when a `pagecli serve --keep-alive` of the same model "
                    "runs (by default such a server is used).")]
NoPoolOpt = Annotated[bool, typer.Option("--no-pool", help="Start with the block-pool panel hidden (/pool).")]
MaxLineOpt = Annotated[int, typer.Option(
    "--max-line-bytes", min=1, metavar="BYTES",
    help="Longest input line read in plain mode (in UTF-8 bytes); a longer one ends the chat with an error.")]
_MAX_LINE_BYTES = 4 << 20  # input_lines.DEFAULT_MAX_LINE_BYTES, written out so this module imports nothing more


@app.command()
@o.engine_flags
def chat(
    model_arg: ModelArg = None, flags: o.RunFlags = None,  # type: ignore[assignment] - filled by engine_flags
    system: SystemOpt = None, session: SessionOpt = None, resume: ResumeOpt = None,
    list_sessions: ListSessionsOpt = False, input: InputOpt = None, jsonl: JsonlOpt = False,
    no_truncate: NoTruncateOpt = False, no_pool: NoPoolOpt = False, max_line_bytes: MaxLineOpt = _MAX_LINE_BYTES,
    server: ServerOpt = None, api_key: ApiKeyOpt = None, local: LocalOpt = False,
    keep_alive: o.KeepAliveStartOpt = None,
) -> None:
    """Chat with a model: streaming replies, cached history, a live view of the KV block pool."""
    from pagecli.chat import session as sessions

    if list_sessions:
        _print_sessions(sessions.list_sessions())
        return
    if model_arg and flags.model and model_arg != flags.model:
        raise PagecliError(f"Two models given ('{model_arg}' and --model '{flags.model}'); pass one.")
    settings = flags.settings(model=model_arg)
    o.refuse_candidates(settings, "chat")
    if server is not None and local:
        raise PagecliError("--server chats through a running server and --local loads the model here; pass one.")
    o.refuse_keep_alive_with(keep_alive, server, local)
    found = None
    if server is None and not local:
        from pagecli.cli.running_server import running_or_started

        found = running_or_started(settings, flags.as_args(settings.model), keep_alive, api_key)
    if server is None and found is None and api_key is not None:
        raise PagecliError("--api-key is the key of a server: pass it with --server URL.")
    code = run_chat(settings, system=system, session=session, resume=resume, input_path=input, jsonl=jsonl,
                    truncate=not no_truncate, pool_visible=not no_pool, max_line_bytes=max_line_bytes,
                    server=server, api_key=api_key, found=found)
    if code:
        raise typer.Exit(code)


def _print_sessions(listing: SessionListing) -> None:
    for note in listing.skipped:  # a damaged file does not hide the others
        typer.echo(note, err=True)
    if not listing.sessions:
        typer.echo("No saved sessions; `pagecli chat --session NAME` starts one.")
        return
    for info in listing.sessions:
        typer.echo(f"{info.name:24} {info.turns:4} turns  {info.updated:25}  {info.model or _DEFAULT_MODEL_LABEL}")


def run_chat(settings: o.RunSettings, system: str | None, session: str | None, resume: str | None,
             input_path: str | None, jsonl: bool, truncate: bool, pool_visible: bool,
             max_line_bytes: int = _MAX_LINE_BYTES, server: str | None = None, api_key: str | None = None,
             found: RunningServer | None = None) -> int:
    """Load the model (or use `server`, or the keep-alive server `found`), then chat on the screen or in plain
    mode; returns the exit code.

    A named session is locked before the model loads (a second chat on it is refused at once, naming
    the process that has it) and stays locked until the chat ends, since every turn saves it."""
    from pagecli.chat import session as sessions

    if session and resume:
        raise PagecliError("Pass --session NAME to start a saved session or --resume NAME to continue one, not both.")
    name = session or resume
    lock = sessions.lock_session(name) if name else None
    try:
        conversation = _starting_conversation(session, resume, system)
        return _chat(settings, conversation, name, lock, input_path, jsonl, truncate, pool_visible, max_line_bytes,
                     server, api_key, found)
    finally:
        if lock is not None:
            lock.release()


def _starting_conversation(session: str | None, resume: str | None, system: str | None) -> Conversation:
    from pagecli.chat import session as sessions
    from pagecli.chat.conversation import Conversation, readable_text

    if session and sessions.session_exists(session):
        raise PagecliError(f"A session named '{session}' exists; continue it with --resume {session}, or pick "
                           "another name.")
    conversation = sessions.load_session(resume).conversation if resume else Conversation()
    if system is not None:
        system = readable_text(system)  # bytes the locale cannot decode arrive as surrogate escapes
        if system != conversation.system:
            conversation.set_system(system)
    return conversation


def _chat(settings: o.RunSettings, conversation: Conversation, name: str | None, lock: SessionLock | None,
          input_path: str | None, jsonl: bool, truncate: bool, pool_visible: bool,
          max_line_bytes: int = _MAX_LINE_BYTES, server: str | None = None, api_key: str | None = None,
          found: RunningServer | None = None) -> int:
    from pagecli.chat.view import ChatOptions
    from pagecli.ui.progress import say

    source = _open_input(input_path)
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # a stray byte in typed or piped text is not worth a failure
    plain = jsonl or input_path is not None or not (sys.stdin.isatty() and sys.stdout.isatty())

    engine: Any = None
    if found is not None:
        engine = _found_server(found, api_key)
    elif server is not None:
        from pagecli.chat.remote import ServerEngine

        engine = ServerEngine(server, api_key)
    if engine is not None:
        from pagecli.chat.remote import RemoteChatController

        controller_class = RemoteChatController
        model_name = settings.model if found is not None else engine.model  # found: the model named here
    else:
        from pagecli.chat.controller import ChatController
        from pagecli.engine import Engine

        say("Loading model ...", style="dim")
        # A chat decodes one reply at a time (refuse_candidates): the engine may pick one stream's fastest weights.
        engine, controller_class = Engine(settings.model, settings.engine.for_one_stream()), ChatController
        model_name = settings.model
    options = ChatOptions(truncate=truncate, session_name=name, autosave=name is not None, model_name=model_name)
    try:
        if plain:
            return _run_plain(engine, controller_class, settings, conversation, options, lock, source, jsonl,
                              max_line_bytes)
        return _run_screen(engine, controller_class, settings, conversation, options, lock, pool_visible)
    finally:
        close = getattr(engine, "close", None)  # finishes the disk prefix store's pending writes
        if close is not None:
            close()


def _found_server(found: RunningServer, api_key: str | None) -> Any:
    """A ServerEngine on the keep-alive server found, or None (said in a dim line) when it stopped meanwhile."""
    from pagecli.chat.remote import ServerEngine
    from pagecli.cli.running_server import announce, fall_back

    try:
        engine = ServerEngine(found.url, api_key)
    except PagecliError as error:
        fall_back(found, error)
        return None
    announce(found)
    return engine


def _open_input(input_path: str | None) -> TextIO:
    if input_path is None or input_path == "-":
        return sys.stdin
    try:
        return open(input_path, encoding="utf-8", errors="replace")  # noqa: SIM115 - read lazily by the loop
    except OSError as exc:
        raise PagecliError(f"Cannot read '{input_path}': {exc.strerror or exc}.") from exc


def _run_plain(engine: Engine, controller_class: type, settings: o.RunSettings, conversation: Conversation,
               options: ChatOptions, lock: SessionLock | None, source: TextIO, jsonl: bool,
               max_line_bytes: int = _MAX_LINE_BYTES) -> int:
    from pagecli.chat.plain import PlainView, input_entries

    controller = controller_class(engine, settings.sampling, PlainView(sys.stdout, sys.stderr, jsonl),
                                conversation, options, lock)
    try:
        controller.run(input_entries(source, max_line_bytes))
    finally:
        controller.close()
        if source is not sys.stdin:
            source.close()
    return 1 if controller.problems else 0


def _run_screen(engine: Engine, controller_class: type, settings: o.RunSettings, conversation: Conversation,
                options: ChatOptions, lock: SessionLock | None, pool_visible: bool) -> int:
    from pagecli.paths import data_dir
    from pagecli.ui.chat_screen import ChatScreen

    screen = ChatScreen(pool_visible=pool_visible, history_file=Path(data_dir()) / "chat_history")
    screen.welcome(options.model_name or _DEFAULT_MODEL_LABEL, engine.stats(), options.session_name)
    if conversation.turns:
        screen.show_transcript(conversation)
    controller = controller_class(engine, settings.sampling, screen, conversation, options, lock)
    try:
        controller.run(screen.entries())
    finally:
        controller.close()
    return 0
