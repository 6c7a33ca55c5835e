"""The Typer app every command registers on: `pagecli.cli` (the composition root, which also holds
`generate`, `profiles` and `main`) and the command modules beside it (chat, bench, cache, serve, doctor,
models) import it from here, so none of them imports the package that imports them."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="pagecli",
    help="Local LLM inference in the terminal: paged KV cache, prefix reuse, continuous batching.",
    add_completion=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120},
)
