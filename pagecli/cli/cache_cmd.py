"""`pagecli cache`: list, summarize, clear and prune the disk prefix store."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from pagecli.bench.units import format_bytes, parse_size
from pagecli.cli.app import app
from pagecli.ui.progress import say

cache_app = typer.Typer(
    help="The disk prefix store: prefixes kept across runs, per model.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(cache_app, name="cache")


@cache_app.callback(invoke_without_command=True)
def cache(ctx: typer.Context) -> None:
    """The disk prefix store: prefixes kept across runs, per model."""
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())

JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object on stdout instead of text.")]
CacheDirOpt = Annotated[Optional[str], typer.Option(
    "--cache-dir", help="Store directory (default: the profile's disk_cache_dir, PAGECLI_CACHE_DIR, or the user "
                        "cache).", metavar="DIR")]
ProfileOpt = Annotated[Optional[str], typer.Option(
    "--profile", "-p", help="Read disk_cache_dir and disk_cache_max_gib from this profile.")]


def _settings(cache_dir: str | None, profile: str | None) -> tuple[Path, int]:
    """The store directory and size cap in bytes: flag, then profile, then defaults."""
    from pagecli.config import load_profile
    from pagecli.store.files import resolve_store_dir

    config = load_profile(profile).engine_config()
    return resolve_store_dir(cache_dir or config.disk_cache_dir), int(config.disk_cache_max_gib * (1 << 30))


def _emit_warnings(warnings: list[str]) -> None:
    for line in warnings:
        say(f"warning: {line}", style="yellow")


def _when(timestamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp)) if timestamp else "never"


@cache_app.command("ls")
def ls(as_json: JsonOpt = False, cache_dir: CacheDirOpt = None, profile: ProfileOpt = None) -> None:
    """Per model: entries, bytes, hits, last use."""
    from pagecli.store.maintenance import list_models

    root, _ = _settings(cache_dir, profile)
    warnings: list[str] = []
    models = list_models(root, warnings)
    _emit_warnings(warnings)
    if as_json:
        typer.echo(json.dumps({"directory": str(root), "models": [asdict(m) for m in models]}))
        return
    if not models:
        typer.echo(f"No cached prefixes in {root}.")
        return
    kv = max(8, *(len(m.kv_dtype) for m in models))  # bfloat16, or bfloat16/kv-int8 for a quantized cache
    typer.echo(f"{'ID':>3}  {'MODEL':32} {'FINGERPRINT':12} {'KV':{kv}} {'BLOCK':>5} {'ENTRIES':>8} {'SIZE':>10} "
               f"{'HITS':>7}  LAST USED")
    for m in models:
        typer.echo(f"{m.model_id:>3}  {m.name[:32]:32} {m.fingerprint_id:12} {m.kv_dtype:{kv}} "
                   f"{m.block_size or '?':>5} "
                   f"{m.entries:>8,} {format_bytes(m.num_bytes):>10} {m.hits:>7,}  {_when(m.last_used)}")


@cache_app.command("stats")
def stats(
    verify: Annotated[bool, typer.Option("--verify", help="Also read every blob and check it against the index "
                                                          "(reads the whole store).")] = False,
    as_json: JsonOpt = False, cache_dir: CacheDirOpt = None, profile: ProfileOpt = None,
) -> None:
    """Totals for the whole store: entries, bytes indexed and on disk, the size cap."""
    from pagecli.store.maintenance import check, store_stats

    root, max_bytes = _settings(cache_dir, profile)
    warnings: list[str] = []
    summary = store_stats(root, warnings)
    _emit_warnings(warnings)
    problems = check(root) if verify and summary.exists else []
    data: dict[str, Any] = {**asdict(summary), "max_bytes": max_bytes}
    if verify:
        data["problems"] = problems
    if as_json:
        typer.echo(json.dumps(data))
        return
    typer.echo(f"directory      {summary.directory}{'' if summary.exists else ' (not created yet)'}")
    typer.echo(f"models         {summary.models}")
    typer.echo(f"entries        {summary.entries:,} blocks")
    typer.echo(f"size           {format_bytes(summary.num_bytes)} of a {format_bytes(max_bytes)} cap "
               f"({format_bytes(summary.disk_bytes)} on disk)")
    typer.echo(f"hits           {summary.hits:,} blocks loaded")
    if summary.unindexed_files:
        typer.echo(f"unindexed      {summary.unindexed_files} files (`pagecli cache prune` removes old ones)")
    if verify:
        typer.echo(f"verified       {len(problems)} problems" + "".join(f"\n  {p}" for p in problems))


@cache_app.command("clear")
def clear(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Only this model: its name, id or "
                                                 "fingerprint as `pagecli cache ls` shows them.")] = None,
    as_json: JsonOpt = False, cache_dir: CacheDirOpt = None, profile: ProfileOpt = None,
) -> None:
    """Delete cached prefixes: all of them, or one model's."""
    from pagecli.store import maintenance

    root, _ = _settings(cache_dir, profile)
    warnings: list[str] = []
    removed = maintenance.clear(root, model, warnings)
    _emit_warnings(warnings)
    if as_json:
        typer.echo(json.dumps({"directory": str(root), "model": model, **asdict(removed)}))
        return
    typer.echo(f"Removed {removed.entries:,} entries ({format_bytes(removed.num_bytes)}) from {root}; "
               f"{format_bytes(removed.bytes_left)} left.")


@cache_app.command("prune")
def prune(
    max_size: Annotated[str, typer.Option("--max-size", help="Size to prune to, like 500MB or 2GiB.")],
    as_json: JsonOpt = False, cache_dir: CacheDirOpt = None, profile: ProfileOpt = None,
) -> None:
    """Delete least recently used prefixes, chain tails first, until the store fits MAX_SIZE."""
    from pagecli.store import maintenance

    max_bytes = parse_size(max_size)
    root, _ = _settings(cache_dir, profile)
    warnings: list[str] = []
    removed = maintenance.prune(root, max_bytes, warnings)
    _emit_warnings(warnings)
    if as_json:
        typer.echo(json.dumps({"directory": str(root), "max_bytes": max_bytes, **asdict(removed)}))
        return
    typer.echo(f"Pruned {removed.entries:,} entries ({format_bytes(removed.num_bytes)}); "
               f"{format_bytes(removed.bytes_left)} left in {root}.")
