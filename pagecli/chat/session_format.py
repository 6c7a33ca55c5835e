"""A session file's JSON read back: every field checked, and the field named when one is wrong.

A session file is user data: it may have been edited, cut short, or written by another tool.
`parse_session` turns any JSON value into a Conversation or raises SessionFormatError naming
the field (`turns[2].user`), never another exception type. Texts come back as valid Unicode
(a JSON file may spell lone surrogates). Token ids are checked to be ids at all here; whether
the model has them is checked when the conversation meets an engine (`Conversation.drop_prefixes_outside`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagecli.chat.conversation import Conversation, KnownPrefix, Turn, readable_text

SESSION_FORMAT_VERSION = 1
MAX_COUNT = 2**53  # a larger turn count is a damaged file, not a long chat
MAX_TOKEN_ID = 2**31 - 1


class SessionFormatError(ValueError):
    """One field of a session file is wrong; the message names it."""


@dataclass(frozen=True)
class SessionData:
    conversation: Conversation
    model: str | None  # the model as the user named it when saving
    updated: str  # ISO 8601, UTC; "" when the file does not say


def parse_session(data: Any) -> SessionData:
    """The session in `data` (the file's parsed JSON), or SessionFormatError naming the wrong field."""
    fields = _object(data, "the file")
    version = _count(fields.get("format", SESSION_FORMAT_VERSION), "format")
    if version > SESSION_FORMAT_VERSION:
        raise SessionFormatError(f"it has format {version}, written by a newer pagecli; upgrade pagecli to read it")
    turns = [_turn(item, f"turns[{index}]") for index, item in enumerate(_list(fields.get("turns", []), "turns"))]
    turns_total = _count(fields.get("turns_total", len(turns)), "turns_total")
    fingerprint, prefixes = _known_prefixes(fields.get("known_prefixes"))
    conversation = Conversation(_optional_text(fields.get("system"), "system") or None, turns,
                                max(turns_total, len(turns)), prefixes, fingerprint)
    conversation.known_prefixes.sort(key=lambda p: len(p.text), reverse=True)
    _optional_text(fields.get("name"), "name")
    return SessionData(conversation, _optional_text(fields.get("model"), "model"),
                       _optional_text(fields.get("updated"), "updated") or "")


def _turn(value: Any, where: str) -> Turn:
    fields = _object(value, where)
    return Turn(_text(fields.get("user"), f"{where}.user"), _text(fields.get("assistant"), f"{where}.assistant"),
                _text(fields.get("finish_reason", "stop"), f"{where}.finish_reason"))


def _known_prefixes(value: Any) -> tuple[str | None, list[KnownPrefix]]:
    if value is None:
        return None, []
    fields = _object(value, "known_prefixes")
    fingerprint = _optional_text(fields.get("fingerprint"), "known_prefixes.fingerprint")
    prefixes = []
    for index, item in enumerate(_list(fields.get("prefixes", []), "known_prefixes.prefixes")):
        where = f"known_prefixes.prefixes[{index}]"
        prefix = _object(item, where)
        text = _text(prefix.get("text"), f"{where}.text")
        prefixes.append(KnownPrefix(text, _token_ids(prefix.get("token_ids"), f"{where}.token_ids")))
    return fingerprint, prefixes


def _token_ids(value: Any, where: str) -> tuple[int, ...]:
    ids = _list(value, where)
    bad = next((i for i, t in enumerate(ids) if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise SessionFormatError(f"'{where}[{bad}]' must be a token id, a whole number from 0 to {MAX_TOKEN_ID} "
                                 f"(got {_shown(ids[bad])})")
    return tuple(ids)


# --- one JSON value of an expected kind -----------------------------------------------------------------
def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SessionFormatError(f"{_named(where)} must be a JSON object (got {_shown(value)})")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise SessionFormatError(f"'{where}' must be a list (got {_shown(value)})")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise SessionFormatError(f"'{where}' must be a string (got {_shown(value)})")
    return readable_text(value)


def _optional_text(value: Any, where: str) -> str | None:
    return None if value is None else _text(value, where)


def _count(value: Any, where: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise SessionFormatError(f"'{where}' must be a whole number from 0 to {MAX_COUNT} (got {_shown(value)})")
    return value


def _named(where: str) -> str:
    return where if where == "the file" else f"'{where}'"


def _shown(value: Any) -> str:
    """A short picture of a JSON value for a message: containers by kind, scalars as JSON spells them."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**15:
        return "a number too large"  # also keeps giant ints away from the digit-count limit of str()
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."
