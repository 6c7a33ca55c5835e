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


def native_dir() -> Path:
    """Compiled CPU kernels; PAGECLI_NATIVE_DIR overrides it (tests share one build this way)."""
    override = os.environ.get("PAGECLI_NATIVE_DIR")
    return Path(override).expanduser() if override else cache_dir() / "native"


def sessions_dir() -> Path:
    return data_dir() / "sessions"


def servers_dir() -> Path:
    """The registry of running `pagecli serve --keep-alive` servers (one small JSON file each)."""
    return cache_dir() / "servers"


def make_private_dir(path: Path) -> None:
    """Create path, and any parent missing too, so that only the user can read them (XDG asks 0700 for
    directories it creates); existing directories are left alone."""
    if path.is_dir():
        return
    make_private_dir(path.parent)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        if path.is_dir():
            return  # another process made it meanwhile
        raise
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
