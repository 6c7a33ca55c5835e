"""Progress and summary of `generate --ray`: the single-process bar, with per-worker throughput and prefix hits."""

from __future__ import annotations

from dataclasses import dataclass

from pagecli.ui.progress import GenerateProgress


@dataclass(frozen=True)
class WorkerFigures:
    name: str
    state: str  # up | restarting | lost
    records: int
    tokens: int  # completion tokens of its records
    tokens_per_s: float
    prefix_hit_tokens: int
    prefix_query_tokens: int
    lost_lines: int  # lines it held when it died, run again elsewhere

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / max(self.prefix_query_tokens, 1)


SHOWN_WORKERS = 4  # the bar is one line: more workers are summed up


def workers_text(workers: list[WorkerFigures]) -> str:
    shown = " | ".join(f"{w.name} {w.tokens_per_s:,.0f} tok/s {w.prefix_hit_rate:.0%} hit"
                       + ("" if w.state == "up" else f" ({w.state})") for w in workers[:SHOWN_WORKERS])
    rest = workers[SHOWN_WORKERS:]
    return shown + (f" | +{len(rest)} more" if rest else "")


class ClusterProgress(GenerateProgress):
    """The generate bar; its last column shows each worker instead of one pool."""

    def update_workers(self, done: int, tokens_per_s: float, workers: list[WorkerFigures]) -> None:
        self._progress.update(self._task, completed=done, rate=f"{tokens_per_s:,.1f} tok/s",
                              pool=workers_text(workers))


def cluster_summary(total: int, errors: int, workers: list[WorkerFigures], elapsed_s: float) -> str:
    tokens = sum(w.tokens for w in workers)
    hits = sum(w.prefix_hit_tokens for w in workers)
    queried = sum(w.prefix_query_tokens for w in workers)
    lines = [f"Done: {total - errors} completions, {errors} errors; {tokens} tokens in {elapsed_s:.1f} s "
             f"({tokens / max(elapsed_s, 1e-9):.1f} tok/s) on {len(workers)} Ray "
             f"worker{'' if len(workers) == 1 else 's'}; prefix cache served "
             f"{hits / max(queried, 1):.0%} of prompt tokens."]
    for w in workers:
        lost = f"; died holding {w.lost_lines} requests, run again elsewhere" if w.lost_lines else ""
        state = "" if w.state == "up" else f" ({w.state})"
        lines.append(f"  {w.name}{state}: {w.records} requests, {w.tokens} tokens, {w.tokens_per_s:.1f} tok/s, "
                     f"prefix hits {w.prefix_hit_rate:.0%} of {w.prefix_query_tokens:,} prompt tokens{lost}")
    return "\n".join(lines)
