"""What the chat tests share: a small CPU engine, a ChatView that records, and the CLI run in-process."""

from __future__ import annotations

import io
import sys

import pagecli.cli.chat  # noqa: F401 - registers `chat` on the app
from pagecli.cli import main
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def make_engine(folder, **overrides) -> Engine:
    config = dict(device="cpu", dtype="float32", attention="torch", block_size=BLOCK_SIZE, num_blocks=96, threads=1)
    return Engine(str(folder), EngineConfig(**{**config, **overrides}))


class RecordingView:
    """A ChatView that keeps what it was asked to show."""

    def __init__(self, on_text=None) -> None:
        self.notices: list[str] = []
        self.problems: list[str] = []
        self.records = []
        self.texts: list[str] = []
        self.stats_shown = []
        self.help_rows = None
        self.transcripts = []
        self.on_text = on_text

    def notice(self, message): self.notices.append(message)
    def problem(self, message): self.problems.append(message)
    def begin_reply(self, live_status): self.live_status = live_status
    def refresh(self): pass
    def end_reply(self, record): self.records.append(record)
    def show_help(self, rows): self.help_rows = rows
    def show_stats(self, stats): self.stats_shown.append(stats)
    def toggle_pool(self, stats, turn): self.notices.append("pool toggled")
    def show_transcript(self, conversation): self.transcripts.append(conversation)

    def reply_text(self, delta):
        self.texts.append(delta)
        if self.on_text is not None:
            self.on_text(delta)


def run_cli(args: list[str], stdin_text: str, capsys, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin_text))
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def cli_args(folder, *extra: str) -> list[str]:
    return ["chat", str(folder), "--device", "cpu", "--dtype", "float32", "--num-blocks", "96", "--threads", "1",
            "--temperature", "0", "--max-tokens", "6", *extra]
