"""Peak resident memory of this process, the one memory figure that means the same on every device."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size so far (weights, KV pool, activations, Python), or None.

    On Linux this is VmHWM: getrusage's ru_maxrss would also count the parent's memory at fork
    time, which makes a child process (the transformers comparison) look as big as its parent.
    """
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (AttributeError, OSError):
        return None
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB
