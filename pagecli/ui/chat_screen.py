"""The chat screen on a terminal: the prompt with line history, the reply streaming under a live
block-pool panel (Rich Live), and the tables for /help and /stats.

It renders what the controller hands it (text, TurnStats, EngineStats snapshots taken between
engine steps) and computes nothing about the engine. Line editing and up/down history come
from Python's readline on input(). With GNU readline, bracketed paste is switched on (CPython
switches it off), so text pasted with newlines arrives as one message; a block between two lines
of three double quotes (`pagecli.chat.multiline`) works everywhere, libedit included.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pagecli.chat.view import LiveStatus, TurnRecord
from pagecli.chat.conversation import Conversation
from pagecli.chat.multiline import BlockReader, Entry, UnclosedBlock
from pagecli.chat.turn import TurnStats
from pagecli.engine.stats import EngineStats
from pagecli.ui.pool_panel import format_bytes, pool_panel, turn_line

_REFRESH_INTERVAL_S = 0.1  # at most ten redraws a second
_MAX_DRAW_SHARE = 20  # a redraw that took t seconds waits at least 20 t before the next one
_HISTORY_LINES = 1000
_PANEL_HEIGHT = 10  # lines the panel takes below a streaming reply (map rows, legend, figures, border)


class ChatScreen:
    def __init__(self, console: Console | None = None, pool_visible: bool = True,
                 history_file: Path | None = None) -> None:
        self.console = console or Console(highlight=False)
        self.pool_visible = pool_visible
        self.history_file = history_file
        self._readline = _setup_readline(history_file)
        self._live: Live | None = None
        self._live_status: LiveStatus | None = None
        self._reply: list[str] = []
        self._last_refresh_s = 0.0
        self._interval_s = _REFRESH_INTERVAL_S

    # --- input --------------------------------------------------------------------------------
    def entries(self) -> Iterator[Entry]:
        """What the user types until Ctrl-D or Ctrl-C at the prompt: lines (a paste is one), and blocks
        between two lines of three double quotes as one message. Ctrl-C inside a block drops the block,
        not the chat."""
        reader = BlockReader()
        while True:
            try:
                line = input(self._prompt(reader.in_block))
            except KeyboardInterrupt:
                self.console.print()
                if reader.drop_block():
                    self.notice("Block dropped; nothing was sent.")
                    continue
                self._save_history()
                return
            except EOFError:
                self.console.print()
                if reader.in_block:
                    self.problem(str(UnclosedBlock()))
                self._save_history()
                return
            entry = reader.feed(line)
            if entry is not None:
                yield entry

    def _prompt(self, in_block: bool) -> str:
        text, style = ("...>", "2") if in_block else ("you>", "1;36")
        # \001 and \002 tell readline that the colour codes take no room on the line.
        return f"{text} " if self.console.no_color else f"\001\x1b[{style}m\002{text}\001\x1b[0m\002 "

    def _save_history(self) -> None:
        if self._readline is not None and self.history_file is not None:
            try:
                self.history_file.parent.mkdir(parents=True, exist_ok=True)
                self._readline.write_history_file(str(self.history_file))
            except OSError:
                pass  # history is a convenience; never fail the chat over it

    # --- messages -----------------------------------------------------------------------------
    def welcome(self, model_name: str, stats: EngineStats, session_name: str | None) -> None:
        line = Text("pagecli chat", style="bold")
        line.append(f" · {model_name} · {stats.num_blocks} blocks × {stats.block_size} tokens "
                    f"({format_bytes(stats.kv_bytes_total)} KV) · max_model_len {stats.max_model_len} · "
                    f"{stats.device}/{stats.attention_backend}", style="dim")
        if session_name:
            line.append(f" · session '{session_name}'", style="dim")
        self.console.print(line)
        self.console.print("Type /help for commands; Ctrl-C stops a reply, Ctrl-D leaves.", style="dim")

    def notice(self, message: str) -> None:
        self.console.print(message, style="dim", markup=False)

    def problem(self, message: str) -> None:
        self.console.print(message, style="yellow", markup=False)

    # --- streaming ------------------------------------------------------------------------------
    def begin_reply(self, live_status: LiveStatus) -> None:
        self._reply = []
        self._live_status = live_status
        self._live = Live(self._render(*live_status()), console=self.console, auto_refresh=False,
                          transient=True, vertical_overflow="crop")
        self._live.start()
        self._last_refresh_s = time.perf_counter()

    def reply_text(self, delta: str) -> None:
        self._reply.append(delta)

    def refresh(self) -> None:
        """Called between engine steps. Redraws at most every _REFRESH_INTERVAL_S, and less often when a
        redraw is costly (a snapshot lists every block: a big GPU pool has 100k+), so drawing never takes
        more than about 1/_MAX_DRAW_SHARE of the time the engine could spend generating."""
        now = time.perf_counter()
        if self._live is None or self._live_status is None or now - self._last_refresh_s < self._interval_s:
            return
        self._live.update(self._render(*self._live_status()), refresh=True)
        self._last_refresh_s = time.perf_counter()
        self._interval_s = max(_REFRESH_INTERVAL_S, (self._last_refresh_s - now) * _MAX_DRAW_SHARE)

    def _render(self, stats: EngineStats, turn: TurnStats) -> Group:
        reply_room = max(3, self.console.height - (_PANEL_HEIGHT if self.pool_visible else 2) - 2)
        width = max(20, self.console.width - 1)
        reply = "".join(self._reply)[-reply_room * width:]  # only the tail can show; wrap no more than that
        tail = Text("\n").join(list(Text(reply).wrap(self.console, width))[-reply_room:])
        status = pool_panel(stats, turn, self._cells_per_row()) if self.pool_visible else turn_line(turn)
        return Group(Text("assistant", style="bold green"), tail, status)

    def _cells_per_row(self) -> int:
        return max(16, min(64, self.console.width - 6))

    def end_reply(self, record: TurnRecord | None) -> None:
        status = self._live_status() if (self._live_status and record is not None) else None
        if self._live is not None:
            self._live.stop()
        self._live = None
        self._live_status = None
        if record is None:
            return
        self.console.print(Text("assistant", style="bold green"))
        self.console.print(Text(record.result.text))
        if record.result.finish_reason == "abort":
            self.console.print("[stopped]", style="yellow", markup=False)
        elif record.result.finish_reason == "length":
            self.console.print("[reply cut at max_tokens; /set max_tokens=N for longer ones]", style="dim",
                               markup=False)
        if status is not None and self.pool_visible:
            self.console.print(pool_panel(status[0], record.result.stats, self._cells_per_row()))
        else:
            self.console.print(turn_line(record.result.stats), style="dim")

    # --- commands -------------------------------------------------------------------------------
    def show_help(self, rows: list[tuple[str, str]]) -> None:
        table = Table(show_header=False, box=None, padding=(0, 2))
        for usage, what in rows:
            table.add_row(Text(usage, style="bold"), Text(what))
        self.console.print(table)
        self.console.print('Start a message with // to send text that begins with /; a line holding only """ '
                           "opens and closes a multi-line message.", style="dim", markup=False)

    def show_stats(self, stats: EngineStats) -> None:
        self.console.print(stats_table(stats))

    def toggle_pool(self, stats: EngineStats, turn: TurnStats | None) -> None:
        self.pool_visible = not self.pool_visible
        if self.pool_visible:
            self.console.print(pool_panel(stats, turn, self._cells_per_row()))
        else:
            self.notice("Pool panel hidden; /pool shows it again.")

    def show_transcript(self, conversation: Conversation) -> None:
        if conversation.system:
            self.console.print(Text(f"system: {conversation.system}", style="dim"))
        for turn in conversation.turns:
            self.console.print(Text("you> ", style="bold cyan") + Text(turn.user))
            self.console.print(Text("assistant", style="bold green"))
            self.console.print(Text(turn.assistant))


def stats_table(stats: EngineStats) -> Table:
    """Every field of the snapshot, with byte counts in KiB/MiB/GiB."""
    table = Table(title="engine and pool", show_header=False, title_justify="left")
    table.add_column("figure", style="bold")
    table.add_column("value", justify="right")
    for key, value in stats.to_dict().items():
        shown = format_bytes(value) if key.endswith("bytes") or "_bytes_" in key else value
        if key == "prefix_hit_rate":
            shown = f"{value:.1%}"
        table.add_row(key, str(shown))
    return table


def _setup_readline(history_file: Path | None) -> ModuleType | None:
    """The readline module (line editing, up/down history for input()), or None where Python lacks it."""
    try:
        import readline
    except ImportError:
        return None
    readline.set_history_length(_HISTORY_LINES)
    if "libedit" not in (readline.__doc__ or ""):
        readline.parse_and_bind("set enable-bracketed-paste on")
    if history_file is not None and history_file.is_file():
        try:
            readline.read_history_file(str(history_file))
        except OSError:
            pass
    return readline
