"""Chat: conversation state, prompt building with prefix reuse, history truncation, turns,
multi-line input, slash commands and saved sessions. Plain Python: the Rich screen lives in
`pagecli.ui`, the Typer command in `pagecli.cli.chat`.
"""

from pagecli.chat.controller import ChatController
from pagecli.chat.view import ChatView
from pagecli.chat.conversation import Conversation, KnownPrefix, Turn
from pagecli.chat.turn import StopFlag, TurnResult, TurnStats, run_turn

__all__ = [
    "ChatController", "ChatView", "Conversation", "KnownPrefix", "StopFlag", "Turn", "TurnResult", "TurnStats",
    "run_turn",
]
