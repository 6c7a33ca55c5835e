"""Where pagecli keeps its files: converted models, the disk prefix store, chat sessions.

PAGECLI_HOME moves everything (tests point it at a temp dir); otherwise the platform's
user cache and data directories are used.
"""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir, user_data_dir


def _home() -> Path | None:
    home = os.environ.get("PAGECLI_HOME")
    return Path(home).expanduser() if home else None


def cache_dir() -> Path:
    home = _home()
    return home / "cache" if home else Path(user_cache_dir("pagecli"))


def data_dir() -> Path:
    home = _home()
    return home / "data" if home else Path(user_data_dir("pagecli"))


def models_dir() -> Path:
    """Converted models (GGUF dequantized to safetensors folders)."""
    return cache_dir() / "models"


def prefix_store_dir() -> Path:
    """The tier-2 prefix store; PAGECLI_CACHE_DIR overrides it."""
    override = os.environ.get("PAGECLI_CACHE_DIR")
    return Path(override).expanduser() if override else cache_dir() / "prefix"


def sessions_dir() -> Path:
    return data_dir() / "sessions"
