"""The engine and sampling flags, declared once, and how they become settings.

Every command that runs the engine is decorated with `@engine_flags`: it then takes every flag in
ENGINE_FLAGS and SAMPLING_FLAGS (plus --model and --profile) and receives them as one `RunFlags`.
Adding a flag is one entry here; each command gets it, and `RunFlags.settings()` carries it into
EngineConfig or SamplingParams.

Precedence: a command-line flag beats the profile, which beats the built-in defaults.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from pagecli.config import RunSettings, load_profile
from pagecli.config.structured import spec_from_schema_file
from pagecli.errors import PagecliError

ENGINE = "Engine"
SAMPLING = "Sampling"


@dataclass(frozen=True)
class Flag:
    """One command-line flag that sets one EngineConfig or SamplingParams field.

    `value` is what the flag holds when the user did not give it (it then leaves the field to the
    profile); `when_given` turns a given value into the field's value where the two differ.
    """

    name: str  # the Python parameter name
    field: str  # the EngineConfig / SamplingParams field it sets
    kind: Any  # the parameter's type
    option: typer.models.OptionInfo
    value: Any = None
    when_given: Callable[[Any], Any] | None = None

    def parameter(self) -> inspect.Parameter:
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=self.value,
                                 annotation=Annotated[self.kind, self.option])

    def given(self, value: Any) -> bool:
        """Whether the user passed this flag (a value other than the one it holds unset)."""
        return value is not None and value != self.value

    def setting(self, value: Any) -> Any:
        """The field's value for what the user passed; None leaves it to the profile."""
        if not self.given(value):
            return None
        return self.when_given(value) if self.when_given else value


def _opt(*decls: str, help: str, panel: str = ENGINE, metavar: str | None = None) -> typer.models.OptionInfo:
    return typer.Option(*decls, help=help, rich_help_panel=panel, metavar=metavar, show_default=False)


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("dtype", "dtype", Optional[str], _opt("--dtype", help="auto|float32|bfloat16|float16.", metavar="DTYPE")),
    Flag("attention", "attention", Optional[str], _opt(
        "--attention", help="auto|triton|torch (auto: triton on CUDA, torch elsewhere).", metavar="NAME")),
    Flag("device", "device", Optional[str], _opt("--device", help="auto|cpu|cuda.", metavar="DEVICE")),
    Flag("block_size", "block_size", Optional[int], _opt("--block-size", help="Tokens per KV block.", metavar="N")),
    Flag("kv_budget_gib", "kv_budget_gib", Optional[float], _opt(
        "--kv-budget-gib", help="KV pool size on CPU, in GiB (default 0.75; 1.5 for a float32 cache, "
        "the same tokens).", metavar="GIB")),
    Flag("num_blocks", "num_blocks", Optional[int], _opt(
        "--num-blocks", help="Exact KV pool size in blocks (overrides the budget).", metavar="N")),
    Flag("max_num_seqs", "max_num_seqs", Optional[int], _opt(
        "--max-num-seqs", help="Most sequences in one batch.", metavar="N")),
    Flag("max_num_batched_tokens", "max_num_batched_tokens", Optional[int], _opt(
        "--max-num-batched-tokens", help="Token budget per step (prefill chunks + decodes).", metavar="N")),
    Flag("max_model_len", "max_model_len", Optional[int], _opt(
        "--max-model-len", help="Longest sequence (prompt + output) in tokens.", metavar="N")),
    Flag("no_prefix_caching", "enable_prefix_caching", bool, _opt(
        "--no-prefix-caching", help="Recompute every prompt instead of reusing cached blocks."),
        value=False, when_given=lambda _given: False),
    Flag("threads", "threads", Optional[int], _opt(
        "--threads", help="CPU threads for torch (default: torch's choice).", metavar="N")),
    Flag("disk_cache", "disk_cache", Optional[bool], _opt(
        "--disk-cache/--no-disk-cache", help="Keep prefixes in the disk prefix store across runs (default: on).")),
    Flag("quantize", "quantize", Optional[str], _opt(
        "--quantize", help="auto|none|int8|int4|gguf: int8 stores the decoder layers' weights as int8 with one "
                           "scale per output channel (about half the bytes read per token); int4 in 4 bits, in "
                           "groups of 32 with a scale and a minimum each (about a third); quantized at load. gguf: "
                           "a .gguf model's own Q4_0/Q4_1/Q8_0 blocks as they are. auto (default): gguf for a .gguf "
                           "model that runs in float32 (CPUs without bf16 arithmetic; the same numbers, a fifth "
                           "of the bytes), none (the weights as loaded) otherwise. CPU only.",
        metavar="KIND")),
    Flag("kv_dtype", "kv_dtype", Optional[str], _opt(
        "--kv-dtype", help="auto|bfloat16|float16|float32|int8|fp8: how the KV cache stores K and V (auto: the "
                           "model's dtype). int8 and fp8 (e4m3) keep one byte per value and a scale per token and "
                           "head: about twice the tokens in the same pool, at a small loss (docs/BENCHMARKS.md).",
        metavar="DTYPE")),
    Flag("speculate", "speculate", Optional[str], _opt(
        "--speculate", help="auto|off|ngram: speculative decoding. ngram (prompt lookup) proposes the tokens "
                            "that followed the latest earlier occurrence of the output's last few tokens (and "
                            "goes on from there while the output keeps following it) and checks them in one "
                            "pass: the tokens plain decoding gives (greedy, or sampled with the same seed), "
                            "several a step where the output repeats its input (editing, quoting); "
                            "one sequence at a time. draft: a draft model's greedy tokens (--draft-model), checked "
                            "the same way. auto (default): ngram on a CPU with pagecli's kernels, off on a GPU.",
        metavar="KIND")),
    Flag("draft_model", "draft_model", Optional[str], _opt(
        "--draft-model", help="With --speculate draft: the model that proposes tokens (a folder, a GGUF file or a "
                              "name, as --model; it must have the main model's tokenizer). Its KV cache comes out "
                              "of the same --kv-budget-gib.", metavar="PATH")),
    Flag("draft_quantize", "draft_quantize", Optional[str], _opt(
        "--draft-quantize", help="--quantize for the draft model (default auto: its own default).",
        metavar="KIND")),
    Flag("num_speculative_tokens", "num_speculative_tokens", Optional[int], _opt(
        "--num-speculative-tokens", help="The most draft tokens checked per step with --speculate (default 8; a "
                                         "sequence starts at 4 and doubles after a pass that accepts them all).",
        metavar="K")),
    Flag("lora", "loras", Optional[list[str]], _opt(
        "--lora", help="A LoRA adapter a request may run, as NAME=PATH (a PEFT adapter folder, or a GGUF LoRA "
                       "file from llama.cpp's convert_lora_to_gguf.py); repeatable. "
                       "Requests pick one by name (JSONL \"lora\", the API's \"model\", chat's /lora NAME).",
        metavar="NAME=PATH"), when_given=lambda pairs: lora_pairs(pairs) or None),
    Flag("max_loras", "max_loras", Optional[int], _opt(
        "--max-loras", help="LoRA adapters held in memory at once (default 8); each loads on first use, the least "
                            "recently used idle one making room.", metavar="N")),
    Flag("max_lora_rank", "max_lora_rank", Optional[int], _opt(
        "--max-lora-rank", help="Refuse adapters of a higher rank (default 64).", metavar="R")),
    Flag("merge_lora", "merge_lora", bool, _opt(
        "--merge-lora", help="Merge the one --lora adapter into the weights at load: every request runs it at the "
                             "base model's speed (a single-adapter run; needs float weights: --quantize none, "
                             "int8 or int4, not a GGUF file's blocks)."), value=False),
    Flag("cache_prefix", "disk_cache_all_prompts", bool, _opt(
        "--cache-prefix", help="Write every prompt's full blocks to the disk prefix store, not only blocks "
                               "shared by two or more requests."), value=False),
)

def lora_pairs(values: list[str]) -> tuple[tuple[str, str], ...]:
    """--lora NAME=PATH values as (name, path) pairs; one sentence for a value without both."""
    pairs = []
    for value in values:
        name, sep, path = value.partition("=")
        if not (sep and name.strip() and path.strip()):
            raise PagecliError(f"--lora takes NAME=PATH (an adapter's name, then its PEFT folder); got '{value}'.")
        pairs.append((name.strip(), path.strip()))
    return tuple(pairs)


SAMPLING_FLAGS: tuple[Flag, ...] = (
    Flag("max_tokens", "max_tokens", Optional[int], _opt(
        "--max-tokens", "-n", help="Most new tokens per request.", panel=SAMPLING, metavar="N")),
    Flag("temperature", "temperature", Optional[float], _opt(
        "--temperature", "-t", help="0 = greedy.", panel=SAMPLING, metavar="T")),
    Flag("top_p", "top_p", Optional[float], _opt(
        "--top-p", help="Nucleus sampling mass.", panel=SAMPLING, metavar="P")),
    Flag("top_k", "top_k", Optional[int], _opt("--top-k", help="0 = off.", panel=SAMPLING, metavar="K")),
    Flag("min_p", "min_p", Optional[float], _opt("--min-p", help="0 = off.", panel=SAMPLING, metavar="P")),
    Flag("repetition_penalty", "repetition_penalty", Optional[float], _opt(
        "--repetition-penalty", help="1 = off.", panel=SAMPLING, metavar="X")),
    Flag("presence_penalty", "presence_penalty", Optional[float], _opt(
        "--presence-penalty", help="Subtracted from generated tokens' logits, once; -2 to 2, 0 = off.",
        panel=SAMPLING, metavar="X")),
    Flag("frequency_penalty", "frequency_penalty", Optional[float], _opt(
        "--frequency-penalty", help="Subtracted from generated tokens' logits per occurrence; -2 to 2, 0 = off.",
        panel=SAMPLING, metavar="X")),
    Flag("seed", "seed", Optional[int], _opt("--seed", help="Same seed, same output.", panel=SAMPLING, metavar="N")),
    Flag("stop", "stop", Optional[list[str]], _opt(
        "--stop", help="Stop string (repeatable).", panel=SAMPLING, metavar="TEXT"),
        when_given=lambda stops: tuple(stops) or None),
    Flag("ignore_eos", "ignore_eos", bool, _opt(
        "--ignore-eos", help="Keep generating past end-of-sequence tokens.", panel=SAMPLING), value=False),
    Flag("n", "n", Optional[int], _opt(
        "--n", help="Candidates per request (parallel sampling): the prompt is prefilled once and its blocks "
                    "shared; with --seed S, candidate i samples with seed S+i. generate only.",
        panel=SAMPLING, metavar="N")),
    Flag("beam_width", "beam_width", Optional[int], _opt(
        "--beam-width", help="Beam search with K beams on shared blocks (needs --temperature 0); each record has "
                             "the --n best beams (default 1) in `choices`, best first, with scores. generate only.",
        panel=SAMPLING, metavar="K")),
    Flag("length_penalty", "length_penalty", Optional[float], _opt(
        "--length-penalty", help="Beam search: a beam scores sum_logprobs / length ** X (default 1; > 0 favours "
                                 "longer beams).", panel=SAMPLING, metavar="X")),
    Flag("json_schema", "structured", Optional[str], _opt(
        "--json-schema", help="Constrain every output to the JSON schema in FILE (or an OpenAI response_format "
                              "object); a request's own response_format wins.", panel=SAMPLING, metavar="FILE"),
        when_given=lambda path: spec_from_schema_file(path)),
)

RAY = "Ray cluster"

# chat and generate: start a keep-alive server where none runs (cli/running_server.py).
KeepAliveStartOpt = Annotated[Optional[str], typer.Option(
    "--keep-alive", metavar="DURATION", show_default=False,
    help="Where no `pagecli serve --keep-alive` of this model and these flags runs, start one in the background "
         "(it stops DURATION after its last request: 30s, 5m, 1h) and use it: the next chat or generate of the "
         "same model then starts in a blink instead of loading the model.")]


def refuse_keep_alive_with(keep_alive: str | None, server: str | None, local: bool, ray: bool = False) -> None:
    """--keep-alive starts and uses a server on this machine: one sentence beside --server, --local or --ray."""
    if keep_alive is None:
        return
    for given, name in ((server is not None, "--server"), (local, "--local"), (ray, "--ray")):
        if given:
            raise PagecliError(f"--keep-alive starts a server here and uses it; leave out {name}.")

# `generate` only: they set pagecli.cluster.launch.ClusterOptions fields (`field`), not engine settings.
RAY_FLAGS: tuple[Flag, ...] = (
    Flag("ray", "enabled", bool, _opt(
        "--ray", help="Run the lines on Ray workers, one engine each (needs pip install 'pagecli[ray]'; see "
                      "docs/RAY.md).", panel=RAY), value=False),
    Flag("ray_address", "address", Optional[str], _opt(
        "--ray-address", help="Ray cluster to join (default: RAY_ADDRESS, else a Ray instance on this machine).",
        panel=RAY, metavar="ADDRESS")),
    Flag("workers", "workers", Optional[int], _opt(
        "--workers", help="Engine workers (default: one per GPU, else the cluster's CPUs / threads per worker).",
        panel=RAY, metavar="N")),
    Flag("threads_per_worker", "threads_per_worker", Optional[int], _opt(
        "--threads-per-worker", help="CPU threads of each worker's engine (default: --threads, else 1).",
        panel=RAY, metavar="T")),
)


@dataclass(frozen=True)
class RayFlags:
    values: dict[str, Any]  # Flag.name -> the value as parsed

    def cluster_fields(self) -> dict[str, Any] | None:
        """The ClusterOptions fields given, or None without --ray; a Ray flag without --ray, or a count below
        1, is one sentence."""
        given = {flag: flag.setting(self.values.get(flag.name, flag.value)) for flag in RAY_FLAGS[1:]}
        given = {flag: value for flag, value in given.items() if value is not None}
        if not self.values.get("ray"):
            if given:
                names = ", ".join(_option_name(flag) for flag in given)
                raise PagecliError(f"{names} only applies with --ray; add --ray or drop it.")
            return None
        for flag, value in given.items():
            if isinstance(value, int) and value < 1:
                raise PagecliError(f"{_option_name(flag)} must be at least 1 (got {value}).")
        return {flag.field: value for flag, value in given.items()}


def _option_name(flag: Flag) -> str:
    return "--" + flag.name.replace("_", "-")


def ray_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give `command` the RAY_FLAGS; it declares a parameter `ray: RayFlags`, which receives them. Goes
    below `@engine_flags`."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "ray"]
    names = {flag.name for flag in RAY_FLAGS}

    @functools.wraps(command)
    def wrapper(**given: Any) -> Any:
        values = {name: given.pop(name) for name in list(given) if name in names}
        return command(ray=RayFlags(values), **given)

    parameters = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind == p.POSITIONAL_OR_KEYWORD else p
                  for p in own] + [flag.parameter() for flag in RAY_FLAGS]
    wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    del wrapper.__wrapped__
    return wrapper


MODEL_FLAGS: tuple[inspect.Parameter, ...] = (
    inspect.Parameter("model", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        Optional[str], _opt("--model", "-m", help="Local HF folder, hub id, .gguf file; omitted: the embedded "
                                                  "SmolLM2-135M-Instruct.", metavar="MODEL")]),
    inspect.Parameter("profile", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        Optional[str], _opt("--profile", "-p", help="Profile name (see `pagecli profiles`) or path to a TOML file.",
                            metavar="PROFILE")]),
)


@dataclass(frozen=True)
class RunFlags:
    """What the user passed of the shared flags: the model, the profile, and each flag's raw value."""

    model: str | None
    profile: str | None
    values: dict[str, Any]  # Flag.name -> the value as parsed (the flag's `value` when not given)

    def settings(self, model: str | None = None, sampling_unless_given: dict[str, Any] | None = None) -> RunSettings:
        """The profile, then these flags on top. `sampling_unless_given` beats the profile but not a flag
        (`bench run` decodes greedily unless --temperature says otherwise)."""
        profile = load_profile(self.profile)
        engine = _given(ENGINE_FLAGS, self.values)
        sampling = {**(sampling_unless_given or {}), **_given(SAMPLING_FLAGS, self.values)}
        return RunSettings(model or self.model or profile.model, profile, profile.engine_config(**engine),
                           profile.sampling_params(**sampling))


    def as_args(self, model: str | None) -> list[str]:
        """The profile and the flags given, as the arguments another pagecli command takes to reach the same
        settings (a keep-alive server started for this command: cli/running_server.py), with `model` as --model."""
        args = [*(["--model", model] if model else []), *(["--profile", self.profile] if self.profile else [])]
        for flag in (*ENGINE_FLAGS, *SAMPLING_FLAGS):
            value = self.values.get(flag.name, flag.value)
            if not flag.given(value):
                continue
            # typer keeps an Annotated option's first declaration as its `default`
            name = next(d for d in (flag.option.default, *flag.option.param_decls) if str(d).startswith("--"))
            if "/" in name:  # --x/--no-x
                on, off = name.split("/")
                args.append(on if value else off)
            elif isinstance(value, bool):
                args.append(name)
            elif isinstance(value, (list, tuple)):
                args.extend(arg for item in value for arg in (name, str(item)))
            else:
                args.extend((name, str(value)))
        return args


def refuse_candidates(settings: RunSettings, command: str) -> None:
    """Commands that show one completion per request refuse n > 1 (from --n or the profile) in one sentence."""
    if settings.sampling.n > 1:
        raise PagecliError(f"`pagecli {command}` shows one completion per request; n {settings.sampling.n} "
                           "(parallel sampling) is for `pagecli generate`. Drop --n or set n = 1 in the profile.")
    if settings.sampling.beam_search:
        raise PagecliError(f"`pagecli {command}` does not run beam search; beam_width {settings.sampling.beam_width} "
                           "is for `pagecli generate`. Drop --beam-width or set beam_width = 1 in the profile.")


def _given(flags: tuple[Flag, ...], values: dict[str, Any]) -> dict[str, Any]:
    settings = {flag.field: flag.setting(values.get(flag.name, flag.value)) for flag in flags}
    return {name: value for name, value in settings.items() if value is not None}


def engine_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give `command` every shared flag. It declares a parameter `flags: RunFlags`, which the
    Typer command replaces with --model, --profile and every engine and sampling flag."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "flags"]
    shared = [*MODEL_FLAGS, *(flag.parameter() for flag in (*ENGINE_FLAGS, *SAMPLING_FLAGS))]
    names = {flag.name for flag in (*ENGINE_FLAGS, *SAMPLING_FLAGS)}

    @functools.wraps(command)
    def wrapper(**given: Any) -> Any:
        bound = signature.bind(**given)
        bound.apply_defaults()  # called directly (bare `pagecli` runs chat), unset flags take their defaults
        kwargs = dict(bound.arguments)
        values = {name: kwargs.pop(name) for name in list(kwargs) if name in names}
        flags = RunFlags(kwargs.pop("model"), kwargs.pop("profile"), values)
        return command(flags=flags, **kwargs)

    parameters = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind == p.POSITIONAL_OR_KEYWORD else p
                  for p in own] + shared
    signature = inspect.Signature(parameters)
    wrapper.__signature__ = signature  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    del wrapper.__wrapped__  # Typer must read the new signature, not the command's own
    return wrapper
