"""Starting and stopping the server: load the engine (while pagecli/serve/startup.py answers "loading" on
the port it took), start its thread, listen with uvicorn, and on SIGTERM or Ctrl-C stop accepting, let what
runs finish within the grace period, cancel the rest, flush the disk prefix store and return 0."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from contextlib import contextmanager, nullcontext
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from pagecli.models.chat_template import apply_chat_template
from pagecli.models.source import model_identity
from pagecli.models.reasoning import prompt_opens_thinking
from pagecli.models.tool_calls import tool_format_of
from pagecli.serve import registry
from pagecli.serve.app import ServeState, create_app
from pagecli.serve.engine_thread import EngineHome, EngineThread
from pagecli.serve.keep_alive import IdleClock, describe
from pagecli.serve.loading import LoadingAnswers
from pagecli.serve.metrics import ServerMetrics
from pagecli.serve.ollama_api import ModelFacts
from pagecli.serve.options import ServeOptions
from pagecli.serve.pool_view import RecentTurns
from pagecli.serve.request_log import RequestLog
from pagecli.ui.progress import load_summary, say


class _Server(uvicorn.Server):
    """uvicorn's server, which also tells the engine thread to refuse new jobs once a signal arrives (or, with
    --keep-alive, once no request has come for that long), and calls on_stop first (it leaves the registry)."""

    def __init__(self, config: uvicorn.Config, engine_thread: EngineThread, request_log: RequestLog,
                 grace_s: float, idle: IdleClock | None = None, on_stop: Callable[[], None] = lambda: None) -> None:
        super().__init__(config)
        self.engine_thread = engine_thread
        self.request_log = request_log
        self.grace_s = grace_s
        self.idle = idle
        self.on_stop = on_stop

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.idle is not None:
            self.idle.restart()  # the keep-alive window counts from the moment requests are taken

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s on the event loop: with --keep-alive, stop once no request has come for that long."""
        if self.idle is not None and not self.should_exit and self.idle.expired():
            self.on_stop()
            self.request_log.note(f"No request for {describe(self.idle.keep_alive_s)} (--keep-alive): stopping.")
            self.engine_thread.stop_accepting()
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_stop()  # a client looking for a server must not find this one during the grace period
        if self.engine_thread.accepting:
            self.request_log.note(f"Stopping: no new requests; {self.engine_thread.pending} sequence(s) still "
                                  f"running get up to {self.grace_s:g} s.")
        self.engine_thread.stop_accepting()
        super().handle_exit(sig, frame)


def model_ids(engine: Any) -> tuple[str, ...]:
    """The id /v1/models lists (the model as the user named it) and the other names a request may use."""
    names = [engine.model_name, Path(engine.model_name).name, engine.loaded.folder.name]
    return tuple(dict.fromkeys(n for n in names if n))


def build_state(engine: Any, settings: Any, options: ServeOptions, request_log: RequestLog,
                block_states: bool = False, home: EngineHome | None = None) -> ServeState:
    """The engine thread (not started; on `home`, the thread that built the engine, when given), metrics
    and everything the routes need."""
    thread: EngineThread | None = None
    metrics = ServerMetrics(lambda: thread.snapshot)  # type: ignore[union-attr]
    recent = RecentTurns()
    thread = EngineThread(engine, options.max_pending, [metrics, recent], block_states=block_states,
                          on_warning=request_log.note, home=home)
    template = getattr(engine, "chat_template", None)
    return ServeState(thread, model_ids(engine), options.api_key, settings.sampling, metrics,
                      request_log, int(time.time()), reasoning=options.reasoning_format == "separate",
                      opens_thinking=_opens_thinking(engine, template), tool_format=tool_format_of(template),
                      recent=recent, facts=ModelFacts.of(engine), adapter_names=adapter_names(engine))


def adapter_names(engine: Any) -> tuple[str, ...]:
    """The LoRA adapters the engine may run (--lora), which /v1/models lists as models."""
    adapters = getattr(engine, "adapters", None)
    return () if adapters is None else tuple(adapters.names)


def _opens_thinking(engine: Any, template: str | None) -> bool:
    """Whether the template's generation prompt ends inside <think>, so replies start in their thinking."""
    if not template:
        return False
    try:
        text = apply_chat_template(engine.tokenizer, [{"role": "user", "content": "Hi"}])
    except Exception:  # noqa: BLE001 - a template that needs more than one user message: assume not
        return False
    return isinstance(text, str) and prompt_opens_thinking(text)


def serve_model(settings: Any, options: ServeOptions, sock: socket.socket, loading: LoadingAnswers) -> int:
    """Load the engine while `loading` answers on `sock` (pagecli/serve/startup.py), then serve on it."""
    from pagecli.engine import Engine

    identity = model_identity(settings.model) if options.keep_alive_s is not None else None
    home, engine = load_on_engine_thread(lambda: Engine(settings.model, settings.engine,
                                                        progress=lambda msg: say(msg, style="dim")))
    say(load_summary(engine.stats()), style="dim")
    use_screen = sys.stdout.isatty() if options.screen is None else options.screen
    screen = _screen(use_screen)
    state = build_state(engine, settings, options, RequestLog(sink=screen.add_line if screen else None), use_screen,
                        home=home)
    if screen is not None:
        screen.attach(state.engine_thread)
    entry = None if identity is None else _entry(settings, options, identity, sock)
    loading.stop()  # from here on a connection waits in the backlog for uvicorn
    try:
        _serve(state, sock, options, screen, entry)
    finally:
        engine.close()  # waits for the disk prefix store's writes
        for warning in engine.take_warnings():
            say(f"Warning: {warning}", style="yellow")
    return 0


def load_on_engine_thread(build: Callable[[], Any]) -> tuple[EngineHome, Any]:
    """The engine, built on the thread that will step it (EngineHome: one OpenMP team, not two)."""
    home = EngineHome()
    return home, home.call(build)


def _screen(enabled: bool) -> Any:
    if not enabled:
        return None
    from pagecli.ui.serve_screen import ServeScreen

    return ServeScreen()


def _entry(settings: Any, options: ServeOptions, identity: str, sock: socket.socket) -> registry.ServerEntry:
    """What the registry records of this server (pagecli/serve/registry.py)."""
    return registry.ServerEntry(
        pid=os.getpid(), host=options.host, port=sock.getsockname()[1], model=settings.model or "",
        model_identity=identity, engine_digest=registry.engine_digest(settings.engine),
        api_key_sha256=registry.key_digest(options.api_key) if options.api_key else None,
        keep_alive_s=float(options.keep_alive_s or 0.0), started=time.time(),
        sampling=registry.sampling_defaults(settings.sampling))


def _serve(state: ServeState, sock: socket.socket, options: ServeOptions, screen: Any,
           entry: registry.ServerEntry | None = None) -> None:
    """Serve until a signal, or with --keep-alive until that long without a request; a keep-alive server is in
    the registry from just before it takes requests until it stops taking them."""
    host, port = sock.getsockname()[:2]
    app: Any = create_app(state)
    idle = None if options.keep_alive_s is None else IdleClock(app, options.keep_alive_s)
    config = uvicorn.Config(idle or app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=max(1, int(options.grace_s)))
    recorded: list[Path] = []

    def leave_registry() -> None:
        while recorded:
            registry.unregister(recorded.pop())

    server = _Server(config, state.engine_thread, state.log, options.grace_s, idle, on_stop=leave_registry)
    state.engine_thread.start()
    stops = "Ctrl-C or SIGTERM stops it"
    if idle is not None:
        stops += f", or {describe(idle.keep_alive_s)} without a request"
    try:
        if entry is not None:
            recorded.append(registry.register(entry))
        say(f"Serving {state.model_ids[0]} on http://{host}:{port}/v1 ({stops}); the web page is "
            f"http://{host}:{port}/")
        with _signals_end_quietly(), screen or nullcontext():
            server.run(sockets=[sock])
    finally:
        leave_registry()
        state.engine_thread.stop(options.grace_s)
        sock.close()
    say("Stopped.", style="dim")


@contextmanager
def _signals_end_quietly() -> Iterator[None]:
    """uvicorn catches SIGINT/SIGTERM while it serves, then raises them again for the handlers found
    before it: make those no-ops, so a stop is a clean exit 0 rather than a KeyboardInterrupt or death."""
    if sys.platform == "win32":
        yield
        return
    before = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
