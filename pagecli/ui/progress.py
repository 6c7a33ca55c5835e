"""Progress for batch generation: a Rich bar on a terminal, nothing but the summary elsewhere."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console

from pagecli.engine.stats import EngineStats


def pool_text(stats: EngineStats) -> str:
    return (f"pool: {stats.blocks_active} active, {stats.blocks_cached} cached, "
            f"{stats.blocks_free} free of {stats.num_blocks}")


def load_summary(stats: EngineStats) -> str:
    """The start-up line: where the model runs and how big the weights and the KV pool are."""
    mib = 1 << 20
    weights = stats.weight_forms or stats.dtype  # the weight plan's summary (a snapshot from elsewhere may lack it)
    return (f"Model on {stats.device} ({weights}, {stats.attention_backend} attention): weights "
            f"{stats.weights_bytes / mib:,.0f} MiB; KV pool {stats.num_blocks:,} blocks x {stats.block_size} tokens = "
            f"{stats.num_blocks * stats.block_size:,} tokens ({stats.kv_bytes_total / mib:,.0f} MiB); "
            f"max {stats.max_model_len:,} tokens per sequence{_draft(stats)}{_adapters(stats)}.")


def _draft(stats: EngineStats) -> str:
    """--speculate draft's model: its weights and its KV pool, which shares the budget above."""
    if not stats.draft_model:
        return ""
    mib = 1 << 20
    return (f"; draft model {stats.draft_model}: weights {stats.draft_weights_bytes / mib:,.0f} MiB, its own KV pool "
            f"of as many blocks {stats.draft_kv_bytes / mib:,.0f} MiB (from the same KV budget)")


def _adapters(stats: EngineStats) -> str:
    """The LoRA adapters' share of memory, each adapter's bytes named, when the engine has any."""
    mib = 1 << 20
    text = f"; LoRA adapter {stats.merged_lora} merged into the weights" if stats.merged_lora else ""
    if stats.adapter_budget_bytes:
        each = "".join(f" {name} {nbytes / mib:,.1f} MiB," for name, nbytes in stats.adapter_sizes)
        text += (f"; LoRA adapters{each} up to {stats.adapter_budget_bytes / mib:,.1f} MiB in memory (loaded on "
                 "first use; each twice: its pairs and their batched copy)")
    return text


def adapter_text(stats: EngineStats) -> str:
    """Per LoRA adapter: requests so far and the pool blocks holding its prefixes; empty without adapters."""
    blocks = dict(stats.adapter_blocks)
    return ", ".join(f"{name} {count} requests / {blocks.get(name, 0)} blocks" for name, count in stats.adapter_requests)


class GenerateProgress:
    """Requests done, output tokens/s and pool occupancy, refreshed as results arrive."""

    def __init__(self, total: int, enabled: bool | None = None, console: Console | None = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console or Console(stderr=True)
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self.total = total
        self._progress = Progress(
            TextColumn("[bold]generate"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
            TextColumn("[dim]{task.fields[pool]}"), TimeElapsedColumn(), console=self.console,
            disable=not self.enabled,
        )
        self._task = self._progress.add_task("generate", total=total, rate="", pool="")

    def __enter__(self) -> "GenerateProgress":
        self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()

    def update(self, done: int, tokens_per_s: float, stats: EngineStats | None) -> None:
        """stats None: no pool to show (the lines run on a server)."""
        pool = "" if stats is None else pool_text(stats)
        self._progress.update(self._task, completed=done, rate=f"{tokens_per_s:,.1f} tok/s", pool=pool)


def say(message: str, style: str = "") -> None:
    """One line to stderr (plain text when stderr is not a terminal)."""
    Console(stderr=True, highlight=False, soft_wrap=True).print(message, style=style or None)


def error_line(message: str) -> None:
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print(f"Error: {message}", style="bold red", markup=False)

