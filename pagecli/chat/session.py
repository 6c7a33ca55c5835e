"""Saved chat sessions: one JSON file per name in sessions_dir(), written atomically.

A file is written to a temporary name in the same folder and renamed over the old one, so a
crash mid-write leaves the previous version, never half a file.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pagecli.chat.conversation import Conversation
from pagecli.errors import PagecliError
from pagecli.paths import make_private_dir, sessions_dir

SESSION_FORMAT_VERSION = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True)
class SessionInfo:
    name: str
    turns: int
    updated: str  # ISO 8601, UTC
    model: str | None


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name) or name.endswith(".json"):
        raise PagecliError(
            f"'{name}' is not a session name; use letters, digits, '.', '_' and '-' (up to 100 characters)."
        )
    return name


def session_path(name: str) -> Path:
    return sessions_dir() / f"{check_name(name)}.json"


def session_exists(name: str) -> bool:
    return session_path(name).is_file()


def default_session_name() -> str:
    return datetime.now().strftime("chat-%Y%m%d-%H%M%S")


def save_session(name: str, conversation: Conversation, model: str | None) -> Path:
    path = session_path(name)
    data = {"format": SESSION_FORMAT_VERSION, "name": name, "model": model,
            "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"), **conversation.to_dict()}
    try:
        make_private_dir(path.parent)  # sessions hold conversations: only the user may read them
        _write_atomically(path, json.dumps(data, ensure_ascii=False, indent=1))
    except OSError as exc:
        raise PagecliError(f"Cannot save session '{name}' to '{path}': {exc.strerror or exc}.") from exc
    return path


def _write_atomically(path: Path, text: str) -> None:
    fd, temp_name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def load_session(name: str) -> tuple[Conversation, dict[str, Any]]:
    """The conversation and the file's other fields (model, updated)."""
    path = session_path(name)
    if not path.is_file():
        raise PagecliError(f"No session named '{name}'; `pagecli chat --list-sessions` shows the saved ones.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("format", SESSION_FORMAT_VERSION) > SESSION_FORMAT_VERSION:
            raise ValueError("written by a newer pagecli")
        conversation = Conversation.from_dict(data)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise PagecliError(f"Session file '{path}' cannot be read ({exc}); move it away or pick another name.") from exc
    return conversation, data


def list_sessions() -> list[SessionInfo]:
    """Saved sessions, most recently updated first; unreadable files are skipped."""
    folder = sessions_dir()
    infos = []
    for path in folder.glob("*.json") if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            infos.append(SessionInfo(path.stem, len(data.get("turns", [])), str(data.get("updated", "")),
                                     data.get("model")))
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            continue
    return sorted(infos, key=lambda info: info.updated, reverse=True)
