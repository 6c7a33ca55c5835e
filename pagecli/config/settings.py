"""Engine and sampling settings: frozen dataclasses, validated when they are built.

One place defines every tunable; profiles (TOML) and command-line flags only fill them in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from pagecli.config.structured import StructuredSpec
from pagecli.errors import PagecliError

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_CHOICES = ("auto", "triton", "torch")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
# auto: a .gguf model's own blocks where a float32 model runs them on pagecli.native, else as loaded
# (pagecli/models/weight_plan.py decides); int8 per channel, 4-bit groups, a GGUF's own blocks (CPU)
QUANTIZE_CHOICES = ("auto", "none", "int8", "int4", "gguf")
# How K/V lie in the pool (pagecli/kv_format.py): the model's dtype, a float dtype, or 8 bits + a scale per row
KV_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "int8", "fp8")
SPECULATE_CHOICES = ("auto", "off", "ngram", "draft")
_GREEDY_BELOW_TEMPERATURE = 1e-5
DEFAULT_CONTEXT_CAP = 8192  # max_model_len when not set: the model's context, capped here
# The CPU pool's default size for a cache of bfloat16 or float16 values: 34,000 tokens of SmolLM2-135M, which
# holds the batch workload (64 prompts x 128 tokens) without preemption. A float32 cache (the default on CPUs
# without AVX512-BF16) gets twice the bytes, the same tokens: at 0.75 GiB it ran that workload 35% slower than at
# 1.5 (docs/BENCHMARKS.md). A quantized cache keeps 0.75 GiB: that it holds more tokens is what it is for.
DEFAULT_KV_BUDGET_GIB = 0.75
MAX_GIB = float(1 << 20)  # a pebibyte: any larger size is a typo, and its byte count overflows a float
MAX_CANDIDATES = 256  # n per request: more is a typo, and each candidate is a running sequence
MAX_LENGTH_PENALTY = 10.0  # beams score by generated_len ** length_penalty: finite for any length (1e6 ** 10)
MAX_THREADS = 1024  # more than the largest machines' cores; torch would try to start them all
DEFAULT_MAX_LORAS = 8  # LoRA adapters held in memory at once (each loaded on first use)
DEFAULT_MAX_LORA_RANK = 64  # an adapter of a higher rank is refused at start
MAX_LORA_SCALE = 100.0  # a request's lora_scale beyond this is a typo


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise PagecliError(message)


def _bias_pairs(bias: dict) -> tuple[tuple[int, float], ...]:
    """A logit_bias object ({"token id": bias}, keys as JSON writes them) as sorted (id, bias) pairs."""
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise PagecliError(f"logit_bias keys must be token ids (got {key!r}).") from None
        _require(not isinstance(value, bool) and isinstance(value, (int, float)),
                 f"logit_bias values must be numbers (got {value!r} for token {key}).")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def _require_finite_numbers(settings: object) -> None:
    """inf and nan pass every comparison a range check makes (or fail it with a misleading message)."""
    for f in fields(settings):  # type: ignore[arg-type]
        value = getattr(settings, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise PagecliError(f"{f.name} must be a finite number (got {value}).")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: cache geometry, memory budget and batching limits."""

    block_size: int = 16
    # KV pool size on CPU. Allocated lazily (untouched pages cost nothing), yet checked whole against the RAM
    # available at start-up, since a long run fills every block (engine/pool_sizing.py). None: the default,
    # DEFAULT_KV_BUDGET_GIB for a cache of 2-byte values, more for a float32 one (the same tokens).
    kv_budget_gib: float | None = None
    gpu_memory_fraction: float = 0.85  # share of free GPU memory (after weights) for the KV pool
    num_blocks: int | None = None  # overrides the budget when set
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's context length, capped at DEFAULT_CONTEXT_CAP
    dtype: str = "auto"
    attention: str = "auto"
    device: str = "auto"
    enable_prefix_caching: bool = True
    threads: int | None = None  # torch intra-op threads on CPU; default: torch's choice
    disk_cache: bool = True  # the disk prefix store (tier 2); needs enable_prefix_caching
    disk_cache_dir: str | None = None  # default: PAGECLI_CACHE_DIR, else the user cache dir's prefix/
    disk_cache_max_gib: float = 2.0  # store size cap: least recently used chain tails are pruned past it
    disk_cache_all_prompts: bool = False  # also store unshared prompt blocks (generate --cache-prefix)
    quantize: str = "auto"  # decoder-layer weights at load: auto | none | int8 | int4 | gguf (CPU only)
    kv_dtype: str = "auto"  # the KV cache's format: auto (the model's dtype) | bfloat16 | float16 | float32 | int8 | fp8
    # Speculative decoding (engine/speculation.py): auto | off | ngram (prompt lookup) | draft (a draft model's
    # greedy tokens, engine/draft_model.py); greedy and sampled requests. auto: ngram where a checking step runs in
    # the CPU's one-call decode step, off elsewhere; draft only when asked.
    speculate: str = "auto"
    draft_model: str | None = None  # speculate="draft"'s model: a folder, a GGUF file or a name, as the main model
    draft_quantize: str = "auto"  # the draft model's --quantize (its own default unless told)
    num_speculative_tokens: int = 8  # the most drafts checked per step and sequence (each starts at 4: draft_budget)
    speculate_max_ngram: int = 3  # the longest suffix looked up; down to 1
    # Drafts only while at most this many sequences run. In a batch each sequence weighs its drafts against its
    # part of the batch's step, timed at that batch size (draft_budget.RowCost): on a Zen 4, each group run with
    # and without drafts back to back, editing batches of 2-8 ran 1.19-1.66x and open text 0.97-1.00x (bf16);
    # at the avx2 level (float32) 1.20x and 1.00-1.05x (docs/benchmarks/speculation.md). Past 8, not measured.
    speculate_max_batch: int = 8
    # LoRA adapters a request may name (`lora`): (name, path to a PEFT folder) pairs; a dict is taken too.
    loras: tuple[tuple[str, str], ...] = ()
    max_loras: int = DEFAULT_MAX_LORAS  # adapters in memory at once: least recently used ones make room
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    # Merge the one adapter of `loras` into the weights at load: every request runs it, at the speed of the
    # base alone (a single-adapter run); needs the base's float weights (not a GGUF file's blocks).
    merge_lora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.loras, dict):
            object.__setattr__(self, "loras", tuple((str(k), str(v)) for k, v in self.loras.items()))
        elif isinstance(self.loras, list):
            object.__setattr__(self, "loras", tuple(tuple(pair) for pair in self.loras))
        _require_finite_numbers(self)
        _require(self.speculate in SPECULATE_CHOICES,
                 f"speculate must be one of {', '.join(SPECULATE_CHOICES)} (got '{self.speculate}').")
        _require((self.speculate == "draft") == (self.draft_model is not None),
                 "--speculate draft needs --draft-model PATH (a model with the main model's tokenizer), and "
                 "--draft-model is only read with --speculate draft: give both or neither.")
        _require(self.draft_quantize in QUANTIZE_CHOICES,
                 f"draft_quantize must be one of {', '.join(QUANTIZE_CHOICES)} (got '{self.draft_quantize}').")
        _require(1 <= self.num_speculative_tokens <= 32,
                 f"num_speculative_tokens must be between 1 and 32 (got {self.num_speculative_tokens}).")
        _require(self.speculate_max_batch >= 1,
                 f"speculate_max_batch must be at least 1 (got {self.speculate_max_batch}).")
        _require(1 <= self.speculate_max_ngram <= 16,
                 f"speculate_max_ngram must be between 1 and 16 (got {self.speculate_max_ngram}).")
        _require(self.block_size >= 1, f"block_size must be at least 1 (got {self.block_size}).")
        _require(self.kv_budget_gib is None or 0 < self.kv_budget_gib <= MAX_GIB,
                 f"kv_budget_gib must be positive and at most {MAX_GIB:.0f} (got {self.kv_budget_gib}).")
        _require(0 < self.gpu_memory_fraction <= 1, "gpu_memory_fraction must be in (0, 1].")
        _require(self.num_blocks is None or self.num_blocks >= 1, "num_blocks must be at least 1.")
        _require(self.max_num_seqs >= 1, "max_num_seqs must be at least 1.")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1.")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be at least 2.")
        _require(self.dtype in DTYPE_CHOICES, f"dtype must be one of {', '.join(DTYPE_CHOICES)} (got '{self.dtype}').")
        _require(
            self.attention in ATTENTION_CHOICES,
            f"attention must be one of {', '.join(ATTENTION_CHOICES)} (got '{self.attention}').",
        )
        _require(self.device in DEVICE_CHOICES, f"device must be one of {', '.join(DEVICE_CHOICES)}.")
        _require(self.threads is None or 1 <= self.threads <= MAX_THREADS,
                 f"threads must be between 1 and {MAX_THREADS} (got {self.threads}).")
        _require(0 < self.disk_cache_max_gib <= MAX_GIB,
                 f"disk_cache_max_gib must be positive and at most {MAX_GIB:.0f} (got {self.disk_cache_max_gib}).")
        _require(self.disk_cache_dir is None or bool(self.disk_cache_dir.strip()),
                 "disk_cache_dir must name a directory (or be left out for the default).")
        _require(self.quantize in QUANTIZE_CHOICES,
                 f"quantize must be one of {', '.join(QUANTIZE_CHOICES)} (got '{self.quantize}').")
        _require(self.kv_dtype in KV_DTYPE_CHOICES,
                 f"kv_dtype must be one of {', '.join(KV_DTYPE_CHOICES)} (got '{self.kv_dtype}').")
        self._check_loras()

    def for_one_stream(self) -> EngineConfig:
        """This config for a run that decodes one sequence at a time (chat; a one-line generate): max_num_seqs
        1, which lets `--dtype auto` take the weights fastest for one row (models/weight_plan.py,
        blocks_choose_float32: on CPUs with bf16 arithmetic a GGUF model's own blocks in float32 rather than bf16
        floats)."""
        return self if self.max_num_seqs == 1 else replace(self, max_num_seqs=1)

    def _check_loras(self) -> None:
        _require(all(isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(p, str) and p for p in pair)
                     for pair in self.loras), "loras must be NAME=PATH pairs, each with a name and a path.")
        names = [name for name, _ in self.loras]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        _require(duplicate is None, f"LoRA adapter name '{duplicate}' is given twice; give each adapter its own name.")
        _require(self.max_loras >= 1, f"max_loras must be at least 1 (got {self.max_loras}).")
        _require(self.max_lora_rank >= 1, f"max_lora_rank must be at least 1 (got {self.max_lora_rank}).")
        _require(not self.merge_lora or len(self.loras) == 1,
                 f"--merge-lora merges one adapter into the weights; give exactly one --lora NAME=PATH (got "
                 f"{len(self.loras)}), or leave --merge-lora out to run several adapters per request.")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen for one request. temperature 0 means greedy (below 1e-5 too: that is the
    limit, and dividing logits by a smaller temperature overflows)."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted from the logits of tokens generated so far, once (presence) and per occurrence
    # (frequency), each in [-2, 2]; logit_bias adds a value in [-100, 100] to a token's logit. The order of
    # every filter: engine/sampler.py.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a dict is taken too
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # Candidates for the one prompt (parallel sampling): prefilled once, its blocks shared. With a seed,
    # candidate i samples as a lone request with seed + i would (candidate_seed).
    n: int = 1
    # Beam search (engine/beam.py), as transformers defines it: beam_width beams share their blocks; the n best
    # finished beams are returned, best first, scored sum_logprobs / generated_len ** length_penalty.
    # early_stopping: True (stop once beam_width beams finished), False (stop when no running beam can
    # still beat the worst finished one at its current length) or "never" (the canonical bound).
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # Constrained decoding (engine/structured.py): the output follows this JSON schema, regex, choice or grammar.
    structured: StructuredSpec | None = None
    # Which LoRA adapter (a name the engine was given) runs this request, None: the base model; lora_scale
    # multiplies the adapter's own scaling (llama.cpp's --lora-scaled). Carried here with the request's other
    # per-request options so every path in (JSONL, the APIs, chat) hands it to the engine unchanged.
    lora: str | None = None
    lora_scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        _require_finite_numbers(self)
        _require(self.temperature >= 0, f"temperature must be 0 or more (got {self.temperature}).")
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p}).")
        _require(self.top_k >= 0, f"top_k must be 0 (off) or more (got {self.top_k}).")
        _require(0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p}).")
        _require(self.repetition_penalty > 0, f"repetition_penalty must be positive (got {self.repetition_penalty}).")
        _require(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2] (got {self.presence_penalty}).")
        _require(-2 <= self.frequency_penalty <= 2,
                 f"frequency_penalty must be in [-2, 2] (got {self.frequency_penalty}).")
        _require(isinstance(self.logit_bias, tuple) and all(
            isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int) and pair[0] >= 0
            and isinstance(pair[1], (int, float)) and math.isfinite(pair[1]) and -100 <= pair[1] <= 100
            for pair in self.logit_bias),
            "logit_bias must map token ids (0 or more) to biases in [-100, 100].")
        _require(self.max_tokens >= 1, f"max_tokens must be at least 1 (got {self.max_tokens}).")
        _require(self.seed is None or -(1 << 63) <= self.seed < (1 << 64),
                 f"seed must fit in 64 bits (got {self.seed}).")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings.")
        _require(1 <= self.n <= MAX_CANDIDATES, f"n must be between 1 and {MAX_CANDIDATES} (got {self.n}).")
        _require(self.seed is None or self.seed + self.n - 1 < (1 << 64),
                 f"seed + n - 1 must fit in 64 bits: candidate i samples with seed + i (got seed {self.seed}).")
        self._check_beam_search()
        _require(self.lora is None or (isinstance(self.lora, str) and bool(self.lora)),
                 "lora must name an adapter (or be left out for the base model).")
        _require(0 <= self.lora_scale <= MAX_LORA_SCALE,
                 f"lora_scale must be between 0 and {MAX_LORA_SCALE:g} (got {self.lora_scale}).")
        _require(self.structured is None or isinstance(self.structured, StructuredSpec),
                 "structured must be a StructuredSpec (pagecli.config.structured).")
        _require(self.structured is None or self.beam_width == 1,
                 "structured output (response_format) is not supported with beam search; use beam_width 1.")

    def _check_beam_search(self) -> None:
        _require(1 <= self.beam_width <= MAX_CANDIDATES,
                 f"beam_width must be between 1 and {MAX_CANDIDATES} (got {self.beam_width}).")
        _require(abs(self.length_penalty) <= MAX_LENGTH_PENALTY, f"length_penalty must be between "
                 f"-{MAX_LENGTH_PENALTY:g} and {MAX_LENGTH_PENALTY:g} (got {self.length_penalty:g}).")
        _require(isinstance(self.early_stopping, bool) or self.early_stopping == "never",
                 f"early_stopping must be true, false or \"never\" (got {self.early_stopping!r}).")
        if self.beam_width == 1:
            return
        _require(self.greedy, f"beam search (beam_width {self.beam_width}) keeps the most likely beams and does not "
                              f"sample: set temperature 0 (got {self.temperature}).")
        _require(self.n <= self.beam_width, f"n {self.n} is more than beam_width {self.beam_width}: beam search "
                                            "returns at most its beam_width best beams.")
        _require(not self.stop, "stop strings are not supported with beam search; leave 'stop' out "
                                "(beams end at the model's end-of-sequence tokens or at max_tokens).")
        _require(self.repetition_penalty == 1.0, "repetition_penalty is not supported with beam search; leave it at 1.")
        _require(self.presence_penalty == 0.0 and self.frequency_penalty == 0.0 and not self.logit_bias,
                 "presence_penalty, frequency_penalty and logit_bias are not supported with beam search; leave them out.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW_TEMPERATURE

    @property
    def beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs at once after its prompt: its beams, or its n candidates."""
        return self.beam_width if self.beam_search else self.n

    def candidate_seed(self, index: int) -> int | None:
        """The seed candidate `index` of an n > 1 request samples with: seed + index (None: unseeded)."""
        return None if self.seed is None else self.seed + index


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))
