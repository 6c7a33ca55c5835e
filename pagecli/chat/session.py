"""Saved chat sessions: one JSON file per name in sessions_dir(), written atomically under a lock.

A file is written to a temporary name in the same folder and renamed over the old one, so a
crash mid-write leaves the previous version, never half a file. Writing takes the session's lock
(`pagecli.chat.session_lock`), so two processes never save the same session; a chat that
autosaves holds it from start to end. Reading checks every field (`pagecli.chat.session_format`):
a damaged file is one PagecliError naming the file and the field.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from pagecli.chat.conversation import Conversation, readable_text
from pagecli.chat.session_format import SESSION_FORMAT_VERSION, SessionData, SessionFormatError, parse_session
from pagecli.chat.session_lock import LOCKS_FOLDER, SessionLock
from pagecli.errors import PagecliError
from pagecli.paths import make_private_dir, sessions_dir

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class UnreadableSession(PagecliError):
    """A session file that cannot be read; `problem` says what is wrong in it."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"Session file '{path}' cannot be read: {problem}; move it away or pick another name.")
        self.problem = problem


@dataclass(frozen=True)
class SessionInfo:
    name: str
    turns: int
    updated: str  # ISO 8601, UTC
    model: str | None


@dataclass(frozen=True)
class SessionListing:
    sessions: list[SessionInfo]  # most recently updated first
    skipped: list[str] = field(default_factory=list)  # one sentence per file that could not be read


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


def lock_session(name: str) -> SessionLock:
    """The session's lock, held by this process until released; SessionBusy names the process holding it."""
    path = session_path(name)
    try:
        make_private_dir(path.parent / LOCKS_FOLDER)  # sessions hold conversations: only the user may read them
    except OSError as exc:
        raise PagecliError(f"Cannot create the sessions folder '{path.parent}': {exc.strerror or exc}.") from exc
    return SessionLock(name, path).acquire()


def save_session(name: str, conversation: Conversation, model: str | None) -> Path:
    path = session_path(name)
    data = {"format": SESSION_FORMAT_VERSION, "name": name, "model": model,
            "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"), **conversation.to_dict()}
    # Any str can be saved: what UTF-8 cannot hold (surrogates) becomes U+FFFD; it can only sit inside strings.
    text = readable_text(json.dumps(data, ensure_ascii=False, indent=1))
    with lock_session(name):
        try:
            _write_atomically(path, text)
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


def load_session(name: str) -> SessionData:
    path = session_path(name)
    if not path.is_file():
        raise PagecliError(f"No session named '{name}'; `pagecli chat --list-sessions` shows the saved ones.")
    return read_session_file(path)


def read_session_file(path: Path) -> SessionData:
    """The session in `path`, or one PagecliError naming the file and what is wrong in it."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        raise UnreadableSession(path, str(exc.strerror or exc)) from exc
    except UnicodeDecodeError as exc:
        raise UnreadableSession(path, f"it is not UTF-8 text (byte {exc.start})") from None
    try:
        return parse_session(json.loads(text))
    except SessionFormatError as exc:
        raise UnreadableSession(path, str(exc)) from None
    except (ValueError, RecursionError) as exc:  # not JSON, nested too deep, a number too long to read
        raise UnreadableSession(path, f"it is not valid JSON ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def list_sessions() -> SessionListing:
    """Saved sessions, most recently updated first, and a sentence for each file that could not be read."""
    folder = sessions_dir()
    infos, skipped = [], []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            session = read_session_file(path)
        except UnreadableSession as exc:
            skipped.append(f"Skipped {path.name}: {exc.problem}.")
            continue
        infos.append(SessionInfo(path.stem, len(session.conversation.turns), session.updated, session.model))
    return SessionListing(sorted(infos, key=lambda info: info.updated, reverse=True), skipped)
