"""The conversation: system prompt, finished turns, and the token ids the engine already knows.

`known_prefixes` remembers texts whose token ids the model actually saw (the last prompt, and
that prompt plus the reply it generated). The next prompt reuses those ids instead of
re-tokenizing the reply, so its blocks hash the same and come from the prefix cache.
They are tied to the engine fingerprint (tokenizer and chat template included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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

    # --- JSON form (sessions) ----------------------------------------------------------------
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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conversation:
        """Raises KeyError, TypeError or ValueError on malformed data (the session loader words it)."""
        system = data.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError("'system' must be a string")
        turns = []
        for item in data.get("turns", []):
            user, assistant = item["user"], item["assistant"]
            if not isinstance(user, str) or not isinstance(assistant, str):
                raise ValueError("turn texts must be strings")
            turns.append(Turn(user, assistant, str(item.get("finish_reason", "stop"))))
        known = data.get("known_prefixes") or {}
        prefixes = [KnownPrefix(str(p["text"]), tuple(int(t) for t in p["token_ids"]))
                    for p in known.get("prefixes", [])]
        turns_total = int(data.get("turns_total", len(turns)))
        return cls(system or None, turns, max(turns_total, len(turns)), prefixes, known.get("fingerprint"))
