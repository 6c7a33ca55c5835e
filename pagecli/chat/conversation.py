"""The conversation: system prompt, finished turns, and the token ids the engine already knows.

`known_prefixes` remembers texts whose token ids the model actually saw (the prompt a turn
was built on, the last prompt, and that prompt plus the reply it generated). The next prompt
reuses those ids instead of re-tokenizing the reply, so its blocks hash the same and come from
the prefix cache; after /undo or /retry, the shorter ones still match. They are tied to the
engine fingerprint (tokenizer and chat template included); ids read from a session file are kept only
if they decode to their text (`drop_prefixes_unlike`). Every text held here is valid
Unicode: text from outside (arguments, files) goes through `readable_text` first.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_NOT_AN_ESCAPED_BYTE = re.compile("[\ud800-\udc7f\udd00-\udfff]")  # surrogates outside surrogateescape's range


def readable_text(text: str) -> str:
    """`text` with what UTF-8 cannot hold replaced by U+FFFD: the surrogate escapes Python makes of
    undecodable bytes in arguments (valid UTF-8 among them is kept), and lone surrogates a JSON
    file can spell (\\ud800)."""
    if text.isascii():
        return text
    text = _NOT_AN_ESCAPED_BYTE.sub("\ufffd", text)
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


@dataclass(frozen=True)
class KnownPrefix:
    """A rendered text and the exact token ids the engine saw for it."""

    text: str
    token_ids: tuple[int, ...]


@dataclass
class Turn:
    user: str
    assistant: str
    finish_reason: str = "stop"  # stop / length / abort


@dataclass
class Conversation:
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)
    turns_total: int = 0  # turns ever completed, including ones dropped by truncation
    known_prefixes: list[KnownPrefix] = field(default_factory=list)  # longest first
    fingerprint: str | None = None  # the engine the known prefixes belong to

    def messages(self, pending_user: str | None = None, skip_turns: int = 0) -> list[dict[str, str]]:
        """Chat-template messages: system, then turns (minus the oldest `skip_turns`), then the pending message."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for turn in self.turns[skip_turns:]:
            messages.append({"role": "user", "content": turn.user})
            messages.append({"role": "assistant", "content": turn.assistant})
        if pending_user is not None:
            messages.append({"role": "user", "content": pending_user})
        return messages

    def add_turn(self, turn: Turn) -> None:
        self.turns.append(turn)
        self.turns_total += 1

    def take_last_turn(self) -> Turn | None:
        """Remove the newest turn and return it (None when there is none); it no longer counts."""
        if not self.turns:
            return None
        self.turns_total -= 1
        return self.turns.pop()

    def drop_oldest(self, count: int) -> None:
        del self.turns[:count]

    def reset(self) -> None:
        """Forget every turn; the system prompt stays."""
        self.turns.clear()
        self.known_prefixes.clear()

    def set_system(self, system: str | None) -> None:
        self.system = system or None
        self.known_prefixes.clear()

    def remember(self, prefixes: list[KnownPrefix], fingerprint: str) -> None:
        self.known_prefixes = sorted(prefixes, key=lambda p: len(p.text), reverse=True)
        self.fingerprint = fingerprint

    def prefixes_for(self, fingerprint: str) -> list[KnownPrefix]:
        """Known prefixes usable by the engine with this fingerprint (none for another model)."""
        return self.known_prefixes if self.fingerprint == fingerprint else []

    def drop_prefixes_outside(self, vocab_size: int) -> int:
        """Forget known prefixes holding ids the model does not have (an edited session file); how many went.
        They are only a cache hint: without them the history is tokenized and prefilled afresh."""
        kept = [p for p in self.known_prefixes if all(0 <= t < vocab_size for t in p.token_ids)]
        dropped = len(self.known_prefixes) - len(kept)
        self.known_prefixes = kept
        return dropped

    def drop_prefixes_unlike(self, decode: Callable[[Sequence[int]], str]) -> int:
        """Forget known prefixes whose ids do not decode to their text (an edited session file): a prompt
        would start with ids the transcript does not hold. How many went; without them the history is
        tokenized afresh."""
        kept = [p for p in self.known_prefixes if _decodes_to(decode, p)]
        dropped = len(self.known_prefixes) - len(kept)
        self.known_prefixes = kept
        return dropped

    # --- JSON form (sessions; `pagecli.chat.session_format` reads it back) ----------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "turns": [{"user": t.user, "assistant": t.assistant, "finish_reason": t.finish_reason}
                      for t in self.turns],
            "turns_total": self.turns_total,
            "known_prefixes": {
                "fingerprint": self.fingerprint,
                "prefixes": [{"text": p.text, "token_ids": list(p.token_ids)} for p in self.known_prefixes],
            },
        }


def _decodes_to(decode: Callable[[Sequence[int]], str], prefix: KnownPrefix) -> bool:
    try:
        return decode(prefix.token_ids) == prefix.text
    except Exception:  # noqa: BLE001 - ids a tokenizer cannot decode do not match any text
        return False
