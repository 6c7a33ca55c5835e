"""Command-line options shared by every command that runs a model, and how they become settings.

Precedence: a command-line flag beats the profile, which beats the built-in defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from pagecli.config import EngineConfig, Profile, SamplingParams, load_profile

ENGINE = "Engine"
SAMPLING = "Sampling"

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Local HF folder, hub id, .gguf file; omitted: the embedded SmolLM2-135M-Instruct.",
    rich_help_panel=ENGINE)]
ProfileOpt = Annotated[Optional[str], typer.Option(
    "--profile", "-p", help="Profile name (see `pagecli profiles`) or path to a TOML file.", rich_help_panel=ENGINE)]
DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", help="auto|float32|bfloat16|float16.", rich_help_panel=ENGINE)]
AttentionOpt = Annotated[Optional[str], typer.Option(
    "--attention", help="auto|triton|torch (auto: triton on CUDA, torch elsewhere).", rich_help_panel=ENGINE)]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="auto|cpu|cuda.", rich_help_panel=ENGINE)]
BlockSizeOpt = Annotated[Optional[int], typer.Option(
    "--block-size", help="Tokens per KV block.", rich_help_panel=ENGINE)]
KvBudgetOpt = Annotated[Optional[float], typer.Option(
    "--kv-budget-gib", help="KV pool size on CPU, in GiB.", rich_help_panel=ENGINE)]
NumBlocksOpt = Annotated[Optional[int], typer.Option(
    "--num-blocks", help="Exact KV pool size in blocks (overrides the budget).", rich_help_panel=ENGINE)]
MaxSeqsOpt = Annotated[Optional[int], typer.Option(
    "--max-num-seqs", help="Most sequences in one batch.", rich_help_panel=ENGINE)]
MaxBatchedOpt = Annotated[Optional[int], typer.Option(
    "--max-num-batched-tokens", help="Token budget per step (prefill chunks + decodes).", rich_help_panel=ENGINE)]
MaxLenOpt = Annotated[Optional[int], typer.Option(
    "--max-model-len", help="Longest sequence (prompt + output) in tokens.", rich_help_panel=ENGINE)]
NoPrefixOpt = Annotated[bool, typer.Option(
    "--no-prefix-caching", help="Recompute every prompt instead of reusing cached blocks.", rich_help_panel=ENGINE)]
ThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", help="CPU threads for torch (default: torch's choice).", rich_help_panel=ENGINE)]
DiskCacheOpt = Annotated[Optional[bool], typer.Option(
    "--disk-cache/--no-disk-cache", help="Keep prefixes in the disk prefix store across runs (default: on).",
    rich_help_panel=ENGINE)]
CachePrefixOpt = Annotated[Optional[bool], typer.Option(
    "--cache-prefix", help="Write every prompt's full blocks to the disk prefix store, not only blocks "
                           "shared by two or more requests.", rich_help_panel=ENGINE)]

MaxTokensOpt = Annotated[Optional[int], typer.Option(
    "--max-tokens", "-n", help="Most new tokens per request.", rich_help_panel=SAMPLING)]
TemperatureOpt = Annotated[Optional[float], typer.Option(
    "--temperature", "-t", help="0 = greedy.", rich_help_panel=SAMPLING)]
TopPOpt = Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass.", rich_help_panel=SAMPLING)]
TopKOpt = Annotated[Optional[int], typer.Option("--top-k", help="0 = off.", rich_help_panel=SAMPLING)]
MinPOpt = Annotated[Optional[float], typer.Option("--min-p", help="0 = off.", rich_help_panel=SAMPLING)]
RepPenaltyOpt = Annotated[Optional[float], typer.Option(
    "--repetition-penalty", help="1 = off.", rich_help_panel=SAMPLING)]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Same seed, same output.", rich_help_panel=SAMPLING)]
StopOpt = Annotated[Optional[list[str]], typer.Option(
    "--stop", help="Stop string (repeatable).", rich_help_panel=SAMPLING)]
IgnoreEosOpt = Annotated[bool, typer.Option(
    "--ignore-eos", help="Keep generating past end-of-sequence tokens.", rich_help_panel=SAMPLING)]


@dataclass(frozen=True)
class RunSettings:
    model: str | None
    profile: Profile
    engine: EngineConfig
    sampling: SamplingParams


def build_settings(model: str | None, profile_name: str | None, engine: dict[str, Any],
                   sampling: dict[str, Any]) -> RunSettings:
    profile = load_profile(profile_name)
    if engine.pop("no_prefix_caching", False):
        engine["enable_prefix_caching"] = False
    if sampling.get("stop") == []:
        sampling["stop"] = None
    if not sampling.get("ignore_eos"):
        sampling.pop("ignore_eos", None)
    return RunSettings(model or profile.model, profile, profile.engine_config(**engine), profile.sampling_params(**sampling))
