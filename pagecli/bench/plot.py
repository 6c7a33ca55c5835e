"""`bench run --plot FILE.png`: active, cached and free blocks over time, drawn with matplotlib.

matplotlib is an optional extra (`pip install 'pagecli[plot]'`); without it `--plot` fails
before the workload runs, with a message saying so.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from pagecli.bench.report_files import PNG_SOFTWARE
from pagecli.errors import PagecliError

_MISSING = ("--plot needs matplotlib, which is not installed; run `pip install 'pagecli[plot]'` "
            "(or `pip install matplotlib`), or leave out --plot.")


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise PagecliError(_MISSING)


def plot_occupancy(path: str, time_s: Sequence[float], active: Sequence[int], cached: Sequence[int],
                   free: Sequence[int], title: str) -> None:
    """A stacked area chart: the three states always add up to the whole pool."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4), dpi=120)
    axes.stackplot(time_s, active, cached, free, labels=("active", "cached", "free"),
                   colors=("#2ca02c", "#1f77b4", "#d9d9d9"), step="post")
    axes.set_xlabel("time since the workload started (s)")
    axes.set_ylabel("KV blocks")
    axes.set_title(title)
    axes.set_ylim(0, (active[0] + cached[0] + free[0]) if active else 1)
    axes.margins(x=0)
    axes.legend(loc="upper right")
    figure.tight_layout()
    try:
        figure.savefig(path, metadata={"Software": PNG_SOFTWARE})  # marks the file as pagecli's (report_files.py)
    except OSError as exc:
        raise PagecliError(f"Cannot write the plot to '{path}': {exc.strerror or exc}.") from None
    finally:
        plt.close(figure)
