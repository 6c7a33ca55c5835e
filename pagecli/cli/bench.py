"""`pagecli bench memory` (what paging saves, computed from lengths) and `pagecli bench run` (measured)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console

from pagecli.cli.app import app
from pagecli.cli import options as o
from pagecli.errors import PagecliError

if TYPE_CHECKING:
    from pagecli.bench.compare_hf import Comparison, HFJob
    from pagecli.bench.summary import RunTrace
    from pagecli.bench.workloads import Workload
    from pagecli.config import SamplingParams
    from pagecli.engine import Engine

bench_app = typer.Typer(
    help="Memory report and measured runs: what paging saves over contiguous reservation, and how fast it goes.",
    no_args_is_help=True, rich_markup_mode="rich",
)
app.add_typer(bench_app, name="bench")

_DEFAULT_MAX_LEN = 4096
_DEFAULT_HF_BATCH = 8

JsonOpt = Annotated[Optional[str], typer.Option(
    "--json", help="Also write the figures as JSON (schema: docs/bench-json.md); '-' writes stdout.", metavar="FILE")]
ForceOpt = Annotated[bool, typer.Option(
    "--force", help="Overwrite a --json/--plot file even when it is not a report pagecli wrote.")]


# --- bench memory -----------------------------------------------------------------------------


@bench_app.command("memory")
def memory(
    lengths: Annotated[str, typer.Option(
        "--lengths", "-l", help="Request lengths in tokens: 800,2300,3900, a file of numbers, or a distribution "
                                "uniform:MIN-MAX, normal:MEAN,STD, lognormal:MEDIAN,SIGMA (with --count, --seed).")]
    = "uniform:20-4000",
    count: Annotated[int, typer.Option("--count", "-c", help="Lengths to draw from a distribution.")] = 100,
    seed: Annotated[int, typer.Option("--seed", help="Seed for drawn lengths.")] = 0,
    max_len: Annotated[Optional[int], typer.Option(
        "--max-len", help="Slots contiguous reservation gives every request "
                          f"(default: the model's max_model_len, or {_DEFAULT_MAX_LEN} without a model).")] = None,
    block_size: Annotated[str, typer.Option(
        "--block-size", "-b", help="Tokens per block; several to compare: 8,16,32.")] = "16",
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help="Read KV bytes per token from this model's config (folder, .gguf, hub id, or "
                              "'default' for the embedded SmolLM2); no weights are loaded.")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="KV dtype with --model: auto|float32|bfloat16|float16.")]
    = "auto",
    kv_dtype: Annotated[Optional[str], typer.Option(
        "--kv-dtype", help="With --model, add columns for the KV cache in this format (int8|fp8|bfloat16|float16|"
                           "float32, as the engine's --kv-dtype): its bytes and the requests that fit.",
        metavar="DTYPE")] = None,
    kv_bytes_per_token: Annotated[Optional[int], typer.Option(
        "--kv-bytes-per-token", help="KV bytes per token when no --model is named.")] = None,
    budget: Annotated[Optional[str], typer.Option(
        "--budget", help="KV memory to fill, e.g. 8GiB or 500MB: how many requests fit under each scheme.")] = None,
    shared_prefix: Annotated[int, typer.Option(
        "--shared-prefix", help="Tokens at the start of every request that are the same (a system prompt).")] = 0,
    forks: Annotated[Optional[int], typer.Option(
        "--forks", help="Also run the model (--model, else the embedded one) with every length as a prompt: "
                        "parallel sampling (n=N) and beam search (N beams), and measure KV blocks with block "
                        "sharing against per-candidate copies.", metavar="N")] = None,
    fork_tokens: Annotated[int, typer.Option(
        "--fork-tokens", help="New tokens per candidate or beam with --forks.", metavar="T")] = 64,
    lora: Annotated[Optional[list[str]], typer.Option(
        "--lora", help="With --model, a LoRA adapter as NAME=PATH (repeatable): its bytes in memory, beside the KV "
                       "figures (adapters sit outside the KV pool, whose size they do not change).",
        metavar="NAME=PATH")] = None,
    json_path: JsonOpt = None,
    force: ForceOpt = False,
) -> None:
    """What paging saves over contiguous reservation, from request lengths alone (no model run)."""
    from pagecli.bench.json_output import memory_document, write_json
    from pagecli.bench.report_files import check_report_path
    from pagecli.bench.sharing import sharing_document
    from pagecli.bench.lengths import parse_lengths
    from pagecli.bench.memory import memory_report
    from pagecli.bench.units import parse_size
    from pagecli.ui.report import memory_view, print_view

    if model and kv_bytes_per_token is not None:
        raise PagecliError("Give --model or --kv-bytes-per-token, not both.")
    check_report_path(json_path, "json", force)
    _check_memory_flags(dtype, max_len)
    model_kv = None
    if model:
        from pagecli.bench.model_info import model_kv as read_model_kv

        model_kv = read_model_kv(model, dtype)
        kv_bytes_per_token = model_kv.kv_bytes_per_token
    if max_len is None:
        max_len = model_kv.context_len if model_kv else _DEFAULT_MAX_LEN
    drawn = parse_lengths(lengths, count, seed, max_len)
    budget_bytes = parse_size(budget) if budget else None
    report = memory_report(drawn, max_len, _block_sizes(block_size), shared_prefix, kv_bytes_per_token, budget_bytes)
    other = None  # (format name, the same report with the cache in that format)
    if kv_dtype is not None:
        if model_kv is None:
            raise PagecliError("--kv-dtype needs --model (the format's bytes depend on the model's head size).")
        other = (kv_dtype, memory_report(drawn, max_len, _block_sizes(block_size), shared_prefix,
                                         model_kv.kv_bytes_per_token_as(kv_dtype), budget_bytes))
    adapters = _adapter_memory(model, lora, dtype)
    print_view(memory_view(report, model_kv, other, adapters), _console(json_path))
    document = {**memory_document(report, model_kv, other, adapters), "forks": []}
    if forks is not None:
        figures = _measure_forks(model, report.lengths, forks, fork_tokens, _block_sizes(block_size)[0],
                                 _console(json_path))
        document["forks"] = [sharing_document(f) for f in figures]
    if json_path:
        write_json(document, json_path)


def _measure_forks(model: str | None, lengths: tuple[int, ...], width: int, tokens: int, block_size: int,
                   console: Console) -> list[Any]:
    """The --forks scenarios, run on the model with the first block size."""
    from pagecli.bench.sharing import SCENARIOS, measure_sharing, sharing_prompts
    from pagecli.config import EngineConfig, SamplingParams
    from pagecli.engine import Engine
    from pagecli.ui.report import print_view
    from pagecli.ui.sharing_view import sharing_view

    if not 2 <= width <= 256 or tokens < 1:
        raise PagecliError(f"--forks must be from 2 to 256 and --fork-tokens at least 1 (got {width}, {tokens}).")
    config = EngineConfig(block_size=block_size, disk_cache=False, enable_prefix_caching=False,
                          max_num_seqs=max(64, width * len(lengths)))
    engine = Engine(None if model in (None, "default") else model, config)
    prompts = sharing_prompts(engine, lengths, tokens)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1))  # warm-up
    figures = [measure_sharing(engine, prompts, scenario, width, tokens) for scenario in SCENARIOS]
    print_view(sharing_view(figures, block_size), console)
    return figures


def _adapter_memory(model: str | None, lora: list[str] | None, dtype: str) -> tuple[Any, ...]:
    """--lora's adapters' bytes over --model (none without --lora)."""
    if not lora:
        return ()
    if not model:
        raise PagecliError("--lora needs --model (an adapter's bytes depend on the model's shapes and dtype).")
    from pagecli.bench.model_info import adapter_memory
    from pagecli.cli.options import lora_pairs

    return adapter_memory(model, lora_pairs(lora), dtype)


def _check_memory_flags(dtype: str, max_len: int | None) -> None:
    from pagecli.config.settings import DTYPE_CHOICES

    if dtype not in DTYPE_CHOICES:
        raise PagecliError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)} (got '{dtype}').")
    if max_len is not None and max_len < 1:
        raise PagecliError(f"--max-len must be at least 1 (got {max_len}).")


def _block_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise PagecliError(f"--block-size takes whole numbers separated by commas, like 8,16,32 (got '{text}').") \
            from None
    if not sizes:
        raise PagecliError("--block-size needs at least one block size.")
    return sizes


def _console(json_path: str | None) -> Console:
    """Tables go to stdout, or to stderr when the JSON goes to stdout."""
    return Console(stderr=json_path == "-", highlight=False)


# --- bench run --------------------------------------------------------------------------------


@bench_app.command("run")
@o.engine_flags
def run(
    flags: o.RunFlags,
    workload: Annotated[str, typer.Argument(
        help="Built-in workload (mixed, shared-prefix, chat) or a file in generate's format (JSONL or text).")]
    = "mixed",
    count: Annotated[Optional[int], typer.Option(
        "--count", "-c", help="Requests to run (chat: turns); default: mixed 64, shared-prefix 32, chat 8 "
                              "(on CPU: 8, 8, 4), a file: all.")] = None,
    workload_seed: Annotated[int, typer.Option("--workload-seed", help="Seed of the built-in workloads' text.")] = 0,
    json_path: JsonOpt = None,
    plot: Annotated[Optional[str], typer.Option(
        "--plot", help="Draw active/cached/free blocks over time into a PNG (needs matplotlib).",
        metavar="FILE.png")] = None,
    compare: Annotated[Optional[str], typer.Option(
        "--compare", help="Also run the same requests through another implementation: hf (transformers generate).")]
    = None,
    hf_batch_size: Annotated[int, typer.Option(
        "--hf-batch-size", help="Requests per transformers generate call with --compare hf.")] = _DEFAULT_HF_BATCH,
    warmup: Annotated[bool, typer.Option(
        "--warmup/--no-warmup", help="Run one tiny request first, so one-time costs do not count.")] = True,
    progress: Annotated[Optional[bool], typer.Option(
        "--progress/--no-progress", help="Progress bar (default: on a terminal).")] = None,
    force: ForceOpt = False,
) -> None:
    """Run a workload on the engine and report pool occupancy, fragmentation, prefix hits and speed.

    Decoding is greedy unless --temperature is given. --max-tokens sets every request's output length
    (on CPU, built-in workloads default to 16).
    """
    from pagecli.bench.plot import require_matplotlib
    from pagecli.bench.report_files import check_report_path

    if compare not in (None, "hf"):
        raise PagecliError(f"--compare takes 'hf' (transformers generate), got '{compare}'.")
    if hf_batch_size < 1:
        raise PagecliError("--hf-batch-size must be at least 1.")
    if plot:
        require_matplotlib()
    check_report_path(json_path, "json", force)
    check_report_path(plot, "plot", force)
    settings = flags.settings(sampling_unless_given={"temperature": 0.0})
    o.refuse_candidates(settings, "bench run")
    max_tokens = flags.values["max_tokens"]
    count, max_tokens = _cpu_size(workload, settings, count, max_tokens)
    chosen = load_workload(workload, settings.sampling, count, max_tokens, workload_seed)
    if compare:
        check_comparable(chosen)
    run_bench(settings, chosen, json_path=json_path, plot=plot, compare=compare, hf_batch_size=hf_batch_size,
              warmup=warmup, progress=progress)


bench_app.command("throughput", hidden=True, help="Same as `bench run`.")(run)


def _cpu_size(workload: str, settings: o.RunSettings, count: int | None,
              max_tokens: int | None) -> tuple[int | None, int | None]:
    """On a CPU, built-in workloads run a smaller size unless --count / --max-tokens say otherwise."""
    from pagecli.bench.workloads import BUILTIN_WORKLOADS, CPU_MAX_TOKENS
    from pagecli.models.loader import resolve_device
    from pagecli.ui.progress import say

    shape = BUILTIN_WORKLOADS.get(workload)
    if shape is None or (count is not None and max_tokens is not None):
        return count, max_tokens
    if resolve_device(settings.engine.device).type != "cpu":
        return count, max_tokens
    count = shape.cpu_count if count is None else count
    max_tokens = CPU_MAX_TOKENS if max_tokens is None else max_tokens
    say(f"On CPU: {count} of {workload}'s {shape.default_count} requests, {max_tokens} output tokens each "
        "(--count and --max-tokens choose).", style="dim")
    return count, max_tokens


def load_workload(name: str, base: SamplingParams, count: int | None, max_tokens: int | None,
                  seed: int) -> Workload:
    from pathlib import Path

    from pagecli.bench.workloads import BUILTIN_WORKLOADS, builtin_workload

    if name in BUILTIN_WORKLOADS:
        return builtin_workload(name, base, count, max_tokens, seed)
    if Path(name).is_file():
        return file_workload(name, base, count, max_tokens)
    raise PagecliError(
        f"'{name}' is neither a built-in workload ({', '.join(BUILTIN_WORKLOADS)}) nor a file; "
        "pass one of those names or a JSONL/text file in generate's format."
    )


def file_workload(path: str, base: SamplingParams, count: int | None, max_tokens: int | None) -> Workload:
    """A JSONL or text file in `pagecli generate`'s format; its lines' sampling fields apply, but --max-tokens wins."""
    from dataclasses import replace

    from pagecli.bench.workloads import BenchRequest, Workload
    from pagecli.batch.requests import BadLine, detect_format, parse_requests, read_input
    from pagecli.batch.submit import line_sampling

    lines = read_input(path)
    items = list(parse_requests(lines, detect_format(path, lines, "auto")))[:count]
    for item in items:
        if isinstance(item, BadLine):
            raise PagecliError(f"{item.error} in '{path}'; fix the line or leave it out of the benchmark.")
    ids = [item.request_id for item in items]
    unique = len(set(ids)) == len(ids)
    requests = []
    for item in items:
        sampling = line_sampling(base, item.sampling, item.line)  # type: ignore[union-attr]
        if max_tokens:
            sampling = replace(sampling, max_tokens=max_tokens)
        if sampling.n > 1:
            raise PagecliError(f"line {item.line} of '{path}' asks for n {sampling.n}; `bench run` measures one "
                               "completion per request, so leave 'n' out of its workload files.")
        prompt = item.prompt if isinstance(item.prompt, str) else tuple(item.prompt)  # type: ignore[union-attr]
        requests.append(BenchRequest(item.request_id if unique else f"line-{item.line}", prompt, sampling))
    if not requests:
        raise PagecliError(f"'{path}' holds no requests.")
    return Workload(path, tuple(requests))


def sampling_description(samplings: list[SamplingParams]) -> str:
    """How a workload's requests choose tokens, in a few words: greedy, or the sampling settings."""
    def one(s: SamplingParams) -> str:
        if s.greedy:
            return "greedy"
        parts = [f"temperature {s.temperature:g}"]
        parts += [f"{name} {getattr(s, name):g}" for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))
                  if getattr(s, name) != off]
        return ", ".join(parts)

    kinds = sorted({one(s) for s in samplings})
    return kinds[0] if len(kinds) == 1 else "mixed: " + "; ".join(kinds)


def check_comparable(workload: Workload) -> None:
    """--compare hf checks that both produce the same greedy tokens; settings that break that are refused."""
    for request in workload.requests:
        s = request.sampling
        if s.temperature != 0:
            raise PagecliError(f"--compare hf compares greedy outputs, but request '{request.request_id}' samples "
                               f"at temperature {s.temperature}; leave out --temperature (bench is greedy by default).")
        if s.stop or s.repetition_penalty != 1.0:
            raise PagecliError(f"--compare hf needs plain greedy decoding; request '{request.request_id}' sets stop "
                               "strings or a repetition penalty.")


def run_bench(settings: o.RunSettings, workload: Workload, json_path: str | None = None, plot: str | None = None,
              compare: str | None = None, hf_batch_size: int = _DEFAULT_HF_BATCH, warmup: bool = True,
              progress: bool | None = None) -> None:
    from pagecli.bench.json_output import run_document, write_json
    from pagecli.bench.summary import summarize
    from pagecli.ui.progress import say
    from pagecli.ui.report import comparison_view, print_view, run_view

    say("Loading model ...", style="dim")
    label, trace, hf_job = _run_on_engine(settings, workload, warmup, progress, hf_batch_size if compare else None)
    summary = summarize(trace)
    # The engine is gone by now: transformers gets the memory its KV pool held (on a GPU, most of it).
    comparison = _compare_hf(hf_job, trace) if hf_job is not None else None
    after = trace.after
    timeline = {state: [getattr(s.stats, f"blocks_{state}") for s in trace.samples]
                for state in ("active", "cached", "free", "shared")}
    console = _console(json_path)
    print_view(run_view(summary, timeline, after.num_blocks, after.block_size, after.kv_bytes_per_block,
                        after.max_model_len, after.device, after.dtype, after.attention_backend,
                        sampling_description([r.sampling for r in workload.requests])), console)
    if comparison is not None:
        print_view(comparison_view(summary, comparison), console)
    if json_path:
        write_json(run_document(summary, trace, comparison), json_path)
    if plot:
        from pagecli.bench.plot import plot_occupancy

        plot_occupancy(plot, [s.time_s for s in trace.samples], timeline["active"], timeline["cached"],
                       timeline["free"], f"pagecli bench run {workload.name}: KV blocks ({label})")
        say(f"Plot written to {plot}", style="dim")


def _run_on_engine(settings: o.RunSettings, workload: Workload, warmup: bool, progress: bool | None,
                   hf_batch_size: int | None) -> tuple[str, RunTrace, HFJob | None]:
    """Runs the workload; with hf_batch_size, also describes the same requests for transformers. The engine,
    its weights and its KV pool are released before this returns (gc, and the CUDA cache when one is in use)."""
    import gc

    import torch

    from pagecli.bench.run import run_workload
    from pagecli.engine import Engine
    from pagecli.ui.progress import GenerateProgress, say

    with Engine(settings.model, settings.engine, progress=lambda message: say(message, style="dim")) as engine:
        label = engine.model_name
        with GenerateProgress(len(workload.requests), progress) as bar:
            trace = run_workload(engine, workload, label, warmup=warmup, on_progress=bar.update)
        for warning in engine.take_warnings():
            say(warning, style="yellow")
        job = _hf_job(engine, workload, trace, hf_batch_size) if hf_batch_size is not None else None
    del engine
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return label, trace, job


def _hf_job(engine: Engine, workload: Workload, trace: RunTrace, batch_size: int) -> HFJob:
    from pagecli.bench.compare_hf import HFJob, HFRequest

    sampling = {r.request_id: r.sampling for r in workload.requests}
    return HFJob(
        model_folder=str(engine.loaded.folder), dtype=str(engine.loaded.dtype).removeprefix("torch."),
        device=str(engine.loaded.device),
        threads=engine.config.threads, batch_size=batch_size, stop_token_ids=tuple(sorted(engine.stop_token_ids)),
        requests=tuple(
            HFRequest(out.request_id, out.prompt_token_ids, out.max_tokens, sampling[out.request_id].ignore_eos,
                      out.wave)
            for out in trace.outcomes
        ),
    )


def _compare_hf(job: HFJob, trace: RunTrace) -> Comparison:
    from pagecli.bench.compare_hf import comparison, run_in_subprocess
    from pagecli.ui.progress import say

    say(f"Running the same {len(job.requests)} requests through transformers generate ...", style="dim")
    hf = run_in_subprocess(job)
    return comparison({out.request_id: out.output_token_ids for out in trace.outcomes}, hf)


# --- bench perplexity -------------------------------------------------------------------------


@bench_app.command("perplexity")
@o.engine_flags
def perplexity(
    flags: o.RunFlags,
    text_file: Annotated[str, typer.Argument(help="A UTF-8 text file to score (tests/data/declaration.txt is one).",
                                             metavar="FILE")],
    ctx: Annotated[int, typer.Option("--ctx", help="Tokens per window; the second half of each is scored "
                                                   "(as llama-perplexity's -c).")] = 512,
    kl_base: Annotated[str | None, typer.Option(
        "--kl-base", metavar="PATH",
        help="Where PATH does not exist, save this run's next-token distributions there as the base; where it "
             "does, print this run's KL divergence from them (e.g. first --dtype float32, then --quantize int8): "
             "steadier than perplexity on a short text.")] = None,
) -> None:
    """Perplexity over a text file in windows of --ctx tokens, as llama.cpp's llama-perplexity computes it,
    to weigh a quantization (--quantize) against bf16. Lower is better. With --kl-base, also the KL
    divergence from a base run's distributions (llama-perplexity's --kl-divergence)."""
    from pathlib import Path

    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PagecliError(f"Cannot read '{text_file}' as UTF-8 text ({error}).") from error
    run_perplexity(flags.settings(), text, ctx, Path(kl_base) if kl_base else None)


def run_perplexity(settings: o.RunSettings, text: str, ctx: int, kl_base: Any = None) -> None:
    """Load the engine as the flags say, score `text`, print a progress line a window and the figure;
    with kl_base (a Path), save the base there or compare with the one there."""
    from pagecli.bench import kl_divergence as kl
    from pagecli.bench.perplexity import perplexity as compute, scored_windows
    from pagecli.engine import Engine
    from pagecli.ui.progress import say

    base = kl.BaseDistributions.load(kl_base) if kl_base is not None and kl_base.exists() else None
    with Engine(settings.model, settings.engine, progress=lambda message: say(message, style="dim")) as engine:
        def show(done: int, total: int, running: float) -> None:
            typer.echo(f"[{done}/{total}] {running:.4f}", err=True)

        digest = kl.tokens_digest(scored_windows(engine, text, ctx))
        if base is not None:
            kl.check_compatible(base, kl_base, ctx, digest)
        hook = None if kl_base is None else kl.Comparer(base) if base is not None else kl.Recorder()
        result = compute(engine, text, ctx, show, hook)
    quantize = engine.quantize + (" (auto)" if settings.engine.quantize == "auto" else "")
    what = (f"{engine.model_name}, quantize {quantize}, {engine.loaded.dtype}, "
            f"kv {engine.kv_format.name}").replace("torch.", "")
    typer.echo(f"perplexity {result.ppl:.4f} +/- {result.stderr:.4f}  ({engine.model_name}, quantize {quantize}, "
               f"kv {engine.kv_format.name}, "
               f"{result.windows} windows of {result.ctx} tokens, {result.tokens_scored} tokens scored)")
    if isinstance(hook, kl.Recorder):
        hook.base(ctx, digest, what, result.ppl).save(kl_base)
        typer.echo(f"saved this run's top {kl.TOP_K} next tokens at each of {result.tokens_scored} positions to "
                   f"{kl_base} as the --kl-base; run again with the same --kl-base to compare")
    elif isinstance(hook, kl.Comparer):
        typer.echo(kl.describe(hook.result(), base, result.ppl))
