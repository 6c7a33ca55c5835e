"""A listing of the files under some folders, to tell whether a test run changed any of them."""

from __future__ import annotations

import os
from pathlib import Path


def user_files(folders: tuple[Path, ...], skip: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime in ns) for every file under `folders`, leaving out the tree at `skip`."""
    listing: dict[str, tuple[int, int]] = {}
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            if Path(root) == skip or skip in Path(root).parents:
                dirs.clear()
                continue
            for name in files:
                path = os.path.join(root, name)
                try:
                    info = os.stat(path)
                except OSError:
                    continue  # removed while we looked: the next listing will not have it either
                listing[path] = (info.st_size, info.st_mtime_ns)
    return listing
