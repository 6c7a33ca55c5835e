"""The Engine facade: requests in, streamed events and completions out.

`add_request` tokenizes and queues; `step` runs one scheduled forward pass and returns the
events it produced; `stream` and `generate` loop over steps. Everything a caller may want
to show (pool occupancy, prefix hits, preemptions) comes from `stats()`. With the disk
prefix store on, `persist_prefix` keeps blocks across processes; `close` waits for its writes.

A request with `SamplingParams.n > 1` yields n candidates: its prompt is prefilled once, then it
forks (the candidates share its blocks, copy-on-write) and every event and completion names its
candidate by `index` (0 to n-1). With n = 1 everything is as for any request, index 0.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Any

import torch

from pagecli.attention import select_backend
from pagecli.kv_format import resolve_kv_format
from pagecli.config.settings import DEFAULT_CONTEXT_CAP, EngineConfig, SamplingParams
from pagecli.config.structured import StructuredSpec
from pagecli.engine.adapters import AdapterRegistry, adapter_fingerprint
from pagecli.engine.beam_groups import BeamGroups, FinishedBeam
from pagecli.engine.block_pool import BlockPool
from pagecli.engine.detokenizer import IncrementalDetokenizer
from pagecli.engine.draft_model import DraftModel, draft_config
from pagecli.engine.hashing import root_hash
from pagecli.engine.heap import keep_freed_activations, return_freed_load_memory
from pagecli.engine.kv_cache_manager import KVCacheManager
from pagecli.engine.model_runner import ModelRunner
from pagecli.engine.pool_sizing import pool_num_blocks
from pagecli.engine.sampler import make_random, sample, skip_draw
from pagecli.engine.scheduler import Scheduler, SchedulerOutput
from pagecli.engine.sequence import Sequence
from pagecli.engine.speculation import Speculator, resolve_method
from pagecli.engine.stats import EngineStats
from pagecli.engine.structured import GrammarCompiler
from pagecli.models.chat_template import apply_chat_template
from pagecli.models.messages import Conversation, developer_as_system, read_messages
from pagecli.models.tools import template_takes_tools, tools_in_system_message
from pagecli.errors import PagecliError, RequestError, request_error_of
from pagecli.native.interface import CpuOps
from pagecli.models.fingerprint import kv_fingerprint_name, model_fingerprint
from pagecli.models.lora import LoraAdapter, inspect_adapter, load_adapter
from pagecli.models.loader import LoadedModel, load_hf_config, load_model, resolve_device
from pagecli.models.spec import DecoderSpec
from pagecli.models.tokenizer import token_ids_of
from pagecli.models.weight_forms import WeightPlacer
from pagecli.models.weight_plan import plan_for_folder
from pagecli.store.blobs import BlockGeometry
from pagecli.store.files import resolve_store_dir
from pagecli.store.tier import DiskTier

Prompt = str | list[dict[str, Any]] | list[int]
# The fewest logits rows for which the output layer takes the greedy choice as it writes them: at the embedded
# model's width (576), one thread, AMD EPYC Zen 5, it is 9-12% slower than the product and greedy_tokens' pass at 4
# rows (float and bf16 panels), even at 1, and 0-5% faster from 16 rows (scripts/bench_greedy_in_output.py,
# docs/benchmarks/host-time.md).
GREEDY_IN_OUTPUT_MIN_ROWS = 16
_END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass(slots=True)
class RequestEvent:
    """What one step did for one request: new text (possibly empty) and, at the end, why it stopped.
    Its readers never change it; it is not frozen because one is built per token, and a frozen dataclass
    takes about 3x as long to build (measured 6.4 us against 2.3 on the AVX2 EPYC, under load)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    index: int = 0  # the candidate of an n > 1 request, the rank of a beam (0 otherwise)
    score: float | None = None  # a beam's sequence score (beam search only)


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    index: int = 0  # the candidate of an n > 1 request, the rank of a beam (0 otherwise)
    score: float | None = None  # a beam's sequence score (beam search only)


class _Request:
    """Per-sequence text state (one per candidate): the detokenizer and how much text has been emitted."""

    def __init__(self, seq: Sequence, tokenizer: Any) -> None:
        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids)
        self.emitted_chars = 0
        self.holdback = max((len(s) for s in seq.sampling.stop), default=1) - 1
        self.final_text: str | None = None


class Engine:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None,
                 loaded: LoadedModel | None = None, progress: Callable[[str], None] | None = None) -> None:
        self.config = config or EngineConfig()
        self._warnings: list[str] = []
        if self.config.threads:
            self._use_threads(self.config.threads)
        if loaded is None:
            from pagecli.models.source import DEFAULT_MODEL_NAME, resolve_model

            folder, device, dtype = resolve_model(model, progress), resolve_device(self.config.device), self.config.dtype
        else:
            folder, device, dtype = loaded.folder, loaded.device, loaded.dtype
        cpu_ops = self._cpu_ops(device, progress)
        # The config, read once for the plan, the context cap and the model (AutoConfig's, where pagecli cannot
        # read it alone, takes tens of milliseconds a time).
        hf_config = load_hf_config(folder) if loaded is None else loaded.hf_config
        # How every weight is kept and what runs it: one decision (models/weight_plan.py), applied as layers load.
        self.plan = plan_for_folder(folder, dtype, device, self.config.quantize, cpu_ops, hf_config,
                                    one_stream=self.config.max_num_seqs == 1)
        spec = DecoderSpec.from_hf_config(hf_config, folder / "config.json") if loaded is None else loaded.spec
        self.merged_lora = self._adapter_to_merge(spec) if self.config.merge_lora else None
        placer = WeightPlacer(self.plan, cpu_ops, progress, after_layer=return_freed_load_memory,
                              merge=self.merged_lora)
        if loaded is None:
            loaded = load_model(folder, str(self.plan.dtype).removeprefix("torch."), self.config.device,
                                max_positions=self._context_len(spec), layer_ready=placer.layer_ready,
                                layer_provided=placer.layer_provided, hf_config=hf_config)
            model = model or DEFAULT_MODEL_NAME
        placer.finish(loaded.model)
        self.loaded = loaded
        self.model_name = model or loaded.folder.name
        self.tokenizer = loaded.tokenizer
        spec = loaded.spec
        self.backend = select_backend(self.config.attention, loaded.device, cpu_ops)
        # The CPU kernels' greedy and sampling entry points (None: tensor operations on the logits' device).
        self._sampling_ops = cpu_ops
        self.kv_format = resolve_kv_format(self.config.kv_dtype, loaded.dtype, spec.head_dim)
        kv_bytes_per_token = self.kv_format.bytes_per_token(spec.num_layers, spec.num_kv_heads)
        self.kv_bytes_per_block = kv_bytes_per_token * self.config.block_size
        # --speculate draft's model, loaded before the pool is sized: its pool comes out of the same budget.
        self.drafter = self._load_draft_model(progress) if self.config.speculate == "draft" else None
        num_blocks = self._num_blocks()
        self.max_model_len = min(self._model_context_len(), num_blocks * self.config.block_size)
        self.chat_template = getattr(self.tokenizer, "chat_template", None)
        # Quantized weights or another KV format give other KV bytes than the model's dtype: another fingerprint.
        self.fingerprint = model_fingerprint(
            loaded.folder, self.chat_template,
            kv_fingerprint_name(loaded.dtype, self.quantize, self.kv_format, self.plan.rounds_wide(cpu_ops)),
            self.config.block_size,
        )
        if self.merged_lora is not None:  # the weights are the adapter's: its prefixes are not the base's
            self.fingerprint = adapter_fingerprint(self.fingerprint, self.merged_lora.info.content_hash)
        # LoRA adapters: checked now (a mismatched one stops here), loaded on first use; not in the pool's budget.
        per_request = () if self.merged_lora is not None else self.config.loras
        self.adapters = AdapterRegistry(per_request, spec, loaded.dtype, loaded.device, self.config.max_loras,
                                        self.config.max_lora_rank, self.fingerprint, cpu_ops,
                                        triton=self.backend.name == "triton")
        self.pool = BlockPool(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.runner = self._allocate_runner(num_blocks)
        if self.drafter is not None:
            self.drafter.allocate(num_blocks, self.config.block_size)
        if loaded.device.type == "cpu":
            return_freed_load_memory()  # what loading freed, before the heap starts keeping activations
            keep_freed_activations()  # weights and KV pool in place: activations' memory stays for the next step
        self._warned_no_chat_template = False
        self.disk = self._open_disk_tier()
        self.kv = KVCacheManager(self.pool, root_hash(self.fingerprint), self.disk)
        self.scheduler = Scheduler(self.kv, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.stop_token_ids = self._stop_token_ids()
        self.beams = BeamGroups(self.kv, self.scheduler, self.stop_token_ids)
        self.speculate = resolve_method(self.config, loaded.model, self.backend,  # --speculate, auto resolved
                                        self.plan.rows_exact(cpu_ops))
        self.speculator = (Speculator(self.config, self.kv, on_cpu=self.loaded.device.type == "cpu",
                                      drafter=self.drafter) if self.speculate != "off" else None)
        self._requests: dict[str, dict[int, _Request]] = {}  # request_id -> candidate index -> text state
        self._ids = itertools.count()
        self._steps = 0
        self._grammars: GrammarCompiler | None = None  # built with the first constrained request
        self._prompt_tokens_computed = 0
        self._tokens_generated = 0
        self._requests_by_adapter: dict[str, int] = {}  # requests added per LoRA adapter
        self.weights_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())

    @property
    def quantize(self) -> str:
        """The --quantize this engine runs (auto resolved): its weight plan's."""
        return self.plan.quantize

    def _cpu_ops(self, device: torch.device, progress: Callable[[str], None] | None) -> CpuOps | None:
        """pagecli's compiled CPU kernels (None on a GPU, or when they cannot be built: then say so once)."""
        if device.type != "cpu":
            return None
        from pagecli import native

        ops = native.cpu_ops(progress)
        if ops is None and native.enabled():
            self._warnings.append(f"pagecli's CPU kernels are unavailable: {native.unavailable_reason()}; "
                                  "using the slower PyTorch path.")
        return ops

    def _adapter_to_merge(self, spec: DecoderSpec) -> LoraAdapter:
        """--merge-lora's adapter, checked and loaded in float32; one sentence where the weights cannot take it."""
        if self.plan.quantize == "gguf":
            raise PagecliError("--merge-lora adds the adapter into the base model's float weights, and this run keeps "
                               "the GGUF file's quantized blocks (--quantize auto or gguf): add --quantize none (or "
                               "int8/int4, quantized after merging), or leave --merge-lora out to run the adapter "
                               "beside the blocks.")
        [(name, path)] = self.config.loras
        info = inspect_adapter(name, path, spec, self.config.max_lora_rank)
        return load_adapter(info, spec, torch.float32, torch.device("cpu"))

    def _use_threads(self, threads: int) -> None:
        """Set torch's CPU threads; more than the cores this process may run on is allowed, with a warning."""
        torch.set_num_threads(threads)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cores and threads > cores:
            self._warnings.append(
                f"--threads {threads} is more than this machine's {cores} cores; the extra threads wait for each "
                f"other and every step gets slower, so use --threads {cores} or fewer.")

    # --- sizing -----------------------------------------------------------------------------
    def _context_len(self, spec: Any) -> int:
        limit = self.config.max_model_len or min(spec.max_position_embeddings, DEFAULT_CONTEXT_CAP)
        if self.config.max_model_len and self.config.max_model_len > spec.max_position_embeddings:
            raise PagecliError(
                f"max_model_len {self.config.max_model_len} exceeds the model's context of "
                f"{spec.max_position_embeddings} tokens."
            )
        if spec.sliding_window:
            limit = min(limit, spec.sliding_window)  # beyond the window the model attends differently
        return limit

    def _model_context_len(self) -> int:
        return self._context_len(self.loaded.spec)

    def _num_blocks(self) -> int:
        """The pool's size, checked against the memory free for it now that the weights are loaded. With a draft
        model, a block counts its bytes in both pools (the draft's has as many blocks): the budget is the total."""
        draft_bytes = self.drafter.kv_bytes_per_block if self.drafter is not None else 0
        return pool_num_blocks(self.config, self.loaded.device, self.kv_bytes_per_block + draft_bytes,
                               self.kv_format.storage_dtype.itemsize)

    def _load_draft_model(self, progress: Callable[[str], None] | None) -> DraftModel:
        """--draft-model loaded by an engine of its own (engine/draft_model.py); PagecliError for another
        tokenizer than this model's."""
        said = None if progress is None else (lambda message: progress(f"Draft model: {message}"))
        draft = Engine(self.config.draft_model, draft_config(self.config), progress=said)
        self._warnings.extend(f"Draft model: {warning}" for warning in draft.take_warnings())
        drafter = DraftModel(draft, self.loaded.spec.vocab_size)
        drafter.check_tokenizer(self.tokenizer, self.model_name)
        return drafter

    def _allocate_runner(self, num_blocks: int) -> ModelRunner:
        """The model runner and its KV pool tensor; memory taken by others since the check is one sentence."""
        try:
            return ModelRunner(self.loaded, self.backend, num_blocks, self.config.block_size, self.kv_format,
                               self.adapters.slots)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one too
            if not (isinstance(exc, torch.cuda.OutOfMemoryError) or "allocate" in str(exc)):
                raise
            pool_gib = num_blocks * self.kv_bytes_per_block / (1 << 30)
            raise PagecliError(f"The {pool_gib:,.2f} GiB KV pool could not be allocated ({str(exc).splitlines()[0]}); "
                               "lower num_blocks, kv_budget_gib or gpu_memory_fraction.") from exc

    def _open_disk_tier(self) -> DiskTier | None:
        if not (self.config.disk_cache and self.config.enable_prefix_caching):
            return None
        spec = self.loaded.spec
        geometry = BlockGeometry(spec.num_layers, self.config.block_size, spec.num_kv_heads, self.kv_format.row_width,
                                 self.kv_format.storage_dtype)
        return DiskTier.open(
            resolve_store_dir(self.config.disk_cache_dir), self.fingerprint, self.model_name, geometry,
            int(self.config.disk_cache_max_gib * (1 << 30)), self.runner.copy_blocks_in,
            self.runner.copy_blocks_out, self._warnings,
        )

    def _stop_token_ids(self) -> frozenset[int]:
        markers = [m for m in _END_OF_TURN_MARKERS if self.chat_template is None or m in self.chat_template]
        return frozenset({*self.loaded.eos_token_ids, *token_ids_of(self.tokenizer, markers).values()})

    # --- requests -----------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for a plain prompt (str), chat messages (list of dicts) or ids (list of ints).

        Anything about the request itself that stops it (messages in a shape the template refuses,
        text the tokenizer cannot take) raises RequestError, so one bad request never ends a batch.
        """
        try:
            if isinstance(prompt, str):
                return list(self.tokenizer(prompt)["input_ids"])
            if isinstance(prompt, Conversation):
                return self.encode_chat(prompt.messages, prompt.tools)
            if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return self._checked_ids(prompt)  # type: ignore[arg-type]
            return self.encode_chat(prompt)  # type: ignore[arg-type]
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - sorted by request_error_of: a request's fault or a bug
            error = request_error_of(exc, "the prompt could not be tokenized", (TypeError, ValueError))
            if error is None:
                raise
            raise error from exc

    def _checked_ids(self, token_ids: list[int]) -> list[int]:
        vocab_size = self.loaded.spec.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the model's vocabulary (0-{vocab_size - 1})")
        return list(token_ids)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        messages = developer_as_system(read_messages(messages), self.chat_template)
        if tools and not template_takes_tools(self.chat_template):
            messages, tools = tools_in_system_message(messages, tools), None
        if self.chat_template:
            text = apply_chat_template(self.tokenizer, messages, tools=tools)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not self._warned_no_chat_template:
            self._warned_no_chat_template = True
            self._warnings.append("The model has no chat template; chat messages are sent as plain text "
                                  "('role: content' lines, then 'assistant:').")
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        return list(self.tokenizer(text)["input_ids"])

    def add_request(self, prompt: Prompt, sampling: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        sampling = sampling or SamplingParams()
        token_ids = self.encode(prompt)
        if not token_ids:
            raise RequestError("The prompt is empty.")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"The prompt has {len(token_ids)} tokens; this engine holds at most {self.max_model_len} "
                "per sequence (max_model_len or the KV pool). Shorten it or raise max_model_len/kv_budget_gib."
            )
        vocab = self.loaded.spec.vocab_size
        if any(token >= vocab for token, _ in sampling.logit_bias):
            raise RequestError(f"logit_bias names a token id past this model's vocabulary ({vocab} tokens: ids 0 to "
                               f"{vocab - 1}).")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise PagecliError(f"Request id '{request_id}' is already in use.")
        seq = Sequence(request_id, token_ids, sampling, self.max_model_len)
        if sampling.lora is not None and self.merged_lora is not None and sampling.lora == self.merged_lora.name:
            if sampling.lora_scale != 1:
                raise RequestError(f"LoRA adapter '{sampling.lora}' is merged into the weights (--merge-lora) at scale "
                                   "1; another scale needs the adapter run beside the weights (no --merge-lora).")
        elif sampling.lora is not None:
            seq.lora = self.adapters.get(sampling.lora, self._adapters_in_use())  # RequestError if it cannot run
            seq.hash_root = self.adapters.root_hash(sampling.lora)
            self._requests_by_adapter[sampling.lora] = self._requests_by_adapter.get(sampling.lora, 0) + 1
        seq.rng = make_random(sampling)
        if sampling.beam_search:
            self.beams.start(seq)  # RequestError if this engine cannot hold the beams
        if sampling.structured is not None:
            seq.grammar = self._grammar_compiler().new_state(sampling.structured)  # RequestError if invalid
        self._requests[request_id] = {0: _Request(seq, self.tokenizer)}
        self.scheduler.add(seq)
        return request_id

    def _adapters_in_use(self) -> set[str]:
        return {seq.lora.name for seq in (*self.scheduler.running, *self.scheduler.waiting) if seq.lora is not None}

    def check_structured(self, spec: StructuredSpec) -> None:
        """Compile spec now (kept for the requests that use it); RequestError where it cannot be enforced."""
        self._grammar_compiler().compile(spec)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.loaded.spec.vocab_size, self.stop_token_ids)
        return self._grammars

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id):
            self._requests.pop(request_id, None)
            self.beams.drop(request_id)
            if self.drafter is not None:
                self.drafter.forget_gone()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # --- stepping -----------------------------------------------------------------------------
    def step(self) -> list[RequestEvent]:
        drafted = list(self.scheduler.running) if self.speculator else []
        if self.speculator:
            self.speculator.add_drafts(drafted)
        plan = self.scheduler.schedule()
        if self.speculator:
            plan = self.speculator.settle(plan, drafted)
        if plan.is_empty:
            raise RuntimeError("scheduler made no progress with requests pending")  # a bug, not a user error
        if any(item.seq.lora is not None for item in plan.scheduled):
            # One adapter's rows together (decodes still first): its low-rank adds run on contiguous slices.
            plan.scheduled.sort(key=_adapter_order)
        self.runner.copy_blocks(self.kv.take_pending_copies())  # copy-on-write, before anything writes
        sampled = [item.seq for item in plan.scheduled if item.samples]
        timed_rows = self.speculator.timed_rows(plan.scheduled) if self.speculator else None
        started = time.perf_counter()
        # The rows' greedy choices from the output layer where it takes them, for the rows sample() would scan
        # (greedy or constrained ones); kept only while the logits are the step's own rows, unreordered: not
        # asked for a step with drafts (verify re-indexes its rows), nor below GREEDY_IN_OUTPUT_MIN_ROWS.
        drafting = self.speculator is not None and any(seq.num_draft for seq in sampled)
        wants_greedy = (self._sampling_ops is not None and len(sampled) >= GREEDY_IN_OUTPUT_MIN_ROWS and not drafting
                        and any(seq.sampling.greedy or seq.grammar is not None for seq in sampled))
        step_logits, greedy_choices = self.runner.execute(plan.scheduled, wants_greedy)
        logits = step_logits
        yielded: dict[int, list[int]] = {}
        if drafting:
            sampled, logits, yielded = self.speculator.verify(sampled, logits, self._sampling_ops)
        block_size = self.kv.block_size
        for item in plan.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            # A drafting sequence computed its last token and the drafts it keeps (one fewer than it yields).
            num_new = len(yielded[id(seq)]) if yielded and id(seq) in yielded else item.num_new_tokens
            prompt_len = len(seq.prompt_token_ids)
            if start < prompt_len:
                self._prompt_tokens_computed += min(start + num_new, prompt_len) - start
            seq.num_computed_tokens = start + num_new
            if seq.num_computed_tokens // block_size > len(seq.block_hashes):  # a block filled: hash it
                self.kv.commit_full_blocks(seq)
        self._steps += 1
        events_ahead = self._speculated_tokens(plan, yielded) if yielded else []
        sampled, logits, ended = self.beams.take_rows(sampled, logits)
        events = events_ahead + [self._beam_event(beam) for beam in ended]
        sampled, logits = self._fork_finished_prompts(sampled, logits)
        if logits is not step_logits:  # rows taken out, repeated or reordered (drafts, beams, forks)
            greedy_choices = None
        for seq, token_id in zip(sampled, sample(logits, sampled, self._sampling_ops, greedy_choices)):
            if token_id < 0:  # its grammar allows no token: that request ends here, the others run on
                events.append(self._dead_end(seq))
                continue
            events.append(self._on_token(seq, token_id))
            if seq.grammar is not None and len(self.scheduler.running) == 1:
                events.extend(self._forced_tokens(seq))
        if timed_rows is not None and self.speculator is not None:
            self.speculator.observe_step(timed_rows, time.perf_counter() - started)
        if self.drafter is not None:  # finished and preempted sequences' mirrors give their draft blocks back
            self.drafter.forget_gone()
        return events

    def _speculated_tokens(self, plan: SchedulerOutput, yielded: dict[int, list[int]]) -> list[RequestEvent]:
        """The tokens each drafting sequence yields this step, appended one by one as sampled tokens are
        (a stop, a length or EOS among them ends it there: the rest are dropped)."""
        events: list[RequestEvent] = []
        for item in plan.scheduled:
            tokens = yielded.get(id(item.seq))
            if tokens is None:
                continue
            self.speculator.give_back_unused_blocks(item.seq)
            for token_id in tokens:
                events.append(self._on_token(item.seq, token_id))
                if item.seq.is_finished:
                    break
        return events

    def _forced_tokens(self, seq: Sequence) -> list[RequestEvent]:
        """The tokens seq's grammar allows alone after its sampled one, appended now; the next step computes
        them as one chunk, so the fixed parts of a schema take no decode steps of their own. Only for a
        sequence running alone: in a batch the others need the step anyway, and a chunk of several tokens
        turns a decode step into a slower mixed one (measured: 16 constrained sequences 25% slower with it)."""
        events = []
        while not seq.is_finished and (token_id := seq.grammar.forced_token()) is not None:
            skip_draw(seq)
            events.append(self._on_token(seq, token_id))
        return events

    def _fork_finished_prompts(self, sampled: list[Sequence], logits: torch.Tensor
                               ) -> tuple[list[Sequence], torch.Tensor]:
        """Fork each n > 1 request whose prompt this step finished; every candidate samples from the
        prompt's logits row with its own stream. Returns the sequences to sample and their logits rows."""
        if not any(seq.needs_fork for seq in sampled):
            return sampled, logits
        seqs: list[Sequence] = []
        rows: list[int] = []
        for row, seq in enumerate(sampled):
            family = [seq, *self._fork(seq)] if seq.needs_fork else [seq]
            seqs.extend(family)
            rows.extend([row] * len(family))
        return seqs, logits[torch.tensor(rows, device=logits.device)]  # [len(seqs), vocab]

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Candidates 1..n-1 of parent's request: they share its blocks and run right after it."""
        parent.forked = True
        candidates = [parent.fork(i, make_random(parent.sampling, i)) for i in range(1, parent.sampling.n)]
        for candidate in candidates:
            self.kv.share_blocks(parent, candidate)
            if parent.grammar is not None:
                candidate.grammar = parent.grammar.fork(parent.output_token_ids)
            self._requests[parent.request_id][candidate.candidate_index] = _Request(candidate, self.tokenizer)
        self.scheduler.add_forked(parent, candidates)
        return candidates

    def _beam_event(self, beam: FinishedBeam) -> RequestEvent:
        """A returned hypothesis of a finished beam search, as the event that ends its completion."""
        self._requests.pop(beam.request_id, None)
        first, tokens = beam.first, beam.hypothesis.token_ids
        shown = tokens[:-1] if beam.finish_reason == "stop" else tokens
        text = self.tokenizer.decode(list(shown), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        ttft = first.first_token_time_s - first.arrival_time_s if first.first_token_time_s else None
        return RequestEvent(
            request_id=beam.request_id, text=text, token_ids=tokens, finished=True, finish_reason=beam.finish_reason,
            prompt_tokens=first.num_prompt_tokens, completion_tokens=len(tokens), cached_tokens=first.num_cached_tokens,
            ttft_s=ttft, index=beam.rank, score=beam.hypothesis.score,
        )

    def _on_token(self, seq: Sequence, token_id: int) -> RequestEvent:
        req = self._requests[seq.request_id][seq.candidate_index]
        seq.append_token(token_id)
        self._tokens_generated += 1
        params = seq.sampling
        reason = None
        grammar_done = seq.grammar is not None and _grammar_accepts(seq, token_id)
        if grammar_done or (token_id in self.stop_token_ids and not params.ignore_eos):
            reason = "stop"
        else:
            delta = req.detok.add(token_id)
            stop_at = _find_stop(req.detok.text, params.stop, len(delta)) if params.stop and delta else None
            if stop_at is not None:
                req.final_text = req.detok.text[:stop_at]
                reason = "stop"
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= seq.max_model_len:
                reason = "length"
        if reason is not None:
            self._persist_finished_prompt(seq)
            self.scheduler.finish(seq, reason)
        return self._event(req, token_id, reason)

    def _dead_end(self, seq: Sequence) -> RequestEvent:
        """End a sequence whose grammar's mask left no token (finish_reason "error", nothing appended)."""
        req = self._requests[seq.request_id][seq.candidate_index]
        self._warnings.append(f"Request '{seq.request_id}': its output constraint allows no next token; it ends "
                              "here (finish_reason \"error\").")
        self.scheduler.finish(seq, "error")
        return self._event(req, None, "error")

    def _persist_finished_prompt(self, seq: Sequence) -> None:
        """The automatic write policy: when a request finishes, the prompt blocks it found cached
        (so two or more requests used them), or all its prompt blocks with disk_cache_all_prompts."""
        if self.disk is None or seq.candidate_index != 0:
            return  # the candidates of a request share one prompt: it is stored once
        lora = None if seq.lora is None else seq.lora.name
        if self.config.disk_cache_all_prompts:
            self.persist_prefix(seq.prompt_token_ids, lora)
        elif seq.num_cached_tokens:
            self.persist_prefix(seq.prompt_token_ids[: seq.num_cached_tokens], lora)

    def _event(self, req: _Request, token_id: int | None, reason: str | None) -> RequestEvent:
        seq = req.seq
        if reason is None:
            full = req.detok.text
            visible_end = max(req.emitted_chars, len(full) - req.holdback)
        else:
            full = req.final_text if req.final_text is not None else req.detok.text
            visible_end = len(full)
            candidates = self._requests[seq.request_id]
            del candidates[seq.candidate_index]
            if not candidates:
                del self._requests[seq.request_id]
        new_text = full[req.emitted_chars : visible_end]
        req.emitted_chars = visible_end
        ttft = seq.first_token_time_s - seq.arrival_time_s if seq.first_token_time_s else None
        return RequestEvent(
            request_id=seq.request_id, text=new_text, token_ids=() if token_id is None else (token_id,),
            finished=reason is not None,
            finish_reason=reason, prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens, ttft_s=ttft, index=seq.candidate_index,
        )

    def stream(self) -> Iterator[RequestEvent]:
        """Step until every queued request has finished, yielding events as they happen."""
        while self.has_unfinished:
            yield from self.step()

    def generate(self, prompts: Iterable[Prompt], sampling: SamplingParams | None = None) -> list[Completion]:
        """One completion per prompt, in order; with sampling.n > 1, n per prompt (candidate 0 first)."""
        ids = [self.add_request(p, sampling) for p in prompts]
        wanted = set(ids)
        texts: dict[tuple[str, int], list[str]] = {}
        tokens: dict[tuple[str, int], list[int]] = {}
        done: dict[tuple[str, int], Completion] = {}
        for ev in self.stream():
            if ev.request_id not in wanted:
                continue
            key = (ev.request_id, ev.index)
            texts.setdefault(key, []).append(ev.text)
            tokens.setdefault(key, []).extend(ev.token_ids)
            if ev.finished:
                done[key] = Completion(
                    ev.request_id, "".join(texts[key]), tuple(tokens[key]), ev.finish_reason or "stop",
                    ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens, ev.ttft_s, ev.index, ev.score,
                )
        n = (sampling or SamplingParams()).n
        return [done[(i, index)] for i in ids for index in range(n)]

    # --- disk prefix store ----------------------------------------------------------------------
    def persist_prefix(self, token_ids: SequenceOf[int], lora: str | None = None) -> int:
        """Keep the full blocks of token_ids that the pool holds in the disk prefix store.

        Chat calls this at the end of each turn with the conversation's ids so far (prompt and
        reply), so a later process (`chat --resume`) prefills only the new message. The KV is
        copied out here; serializing and writing happen on a background thread. Blocks the
        store already has are skipped. Returns how many blocks were queued (0 without a store). lora: the
        adapter the blocks were computed under (its own chains), None for the base model.
        """
        if self.disk is None:
            return 0
        root = None if lora is None else self.adapters.root_hash(lora)
        return self.disk.persist(self.kv.cached_prefix(token_ids, root))

    def flush_disk_writes(self) -> None:
        """Wait until every queued disk store write has finished."""
        if self.disk is not None:
            self.disk.flush()

    def take_warnings(self) -> list[str]:
        """Warnings since the last call (a corrupt store entry, a store turned off), each reported once."""
        taken = list(self._warnings)
        del self._warnings[: len(taken)]
        return taken

    def close(self) -> None:
        """Finish pending disk store writes and release the store. Also happens at interpreter exit."""
        if self.disk is not None:
            self.disk.close()
            self.disk = None
            self.kv.slower_tier = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- observation ----------------------------------------------------------------------------
    def stats(self, include_block_states: bool = False) -> EngineStats:
        counts = self.pool.counts()
        return EngineStats(
            block_size=self.pool.block_size, num_blocks=counts.total,
            kv_bytes_per_block=self.kv_bytes_per_block, kv_bytes_total=self.runner.kv_bytes,
            weights_bytes=self.weights_bytes,
            blocks_free=counts.free, blocks_cached=counts.cached, blocks_active=counts.active,
            blocks_shared=counts.shared,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions, num_steps=self._steps,
            prompt_tokens_computed=self._prompt_tokens_computed,
            tokens_generated=self._tokens_generated + self.beams.tokens_chosen,
            prefix_query_tokens=self.kv.prefix_query_tokens, prefix_hit_tokens=self.kv.prefix_hit_tokens,
            prefix_disk_hit_tokens=self.kv.prefix_disk_hit_tokens, evictions=self.pool.evictions,
            device=str(self.loaded.device), dtype=str(self.loaded.dtype).removeprefix("torch."),
            attention_backend=self.backend.name, max_model_len=self.max_model_len,
            fork_block_shares=self.kv.fork_block_shares, cow_block_copies=self.kv.cow_block_copies,
            block_references=sum(len(s.block_table) for s in self.scheduler.running),
            slots_unused=sum(len(s.block_table) * self.pool.block_size - s.num_computed_tokens
                             for s in self.scheduler.running),
            block_states=tuple(self.pool.block_states()) if include_block_states else None,
            kv_dtype=self.kv_format.name, quantize=self.quantize, weight_forms=self.plan.summary(),
            adapter_bytes=self.adapters.loaded_bytes, adapter_budget_bytes=self.adapters.budget_bytes,
            adapter_requests=tuple(sorted(self._requests_by_adapter.items())),
            adapter_blocks=tuple(sorted(self.kv.blocks_by_adapter().items())),
            adapter_sizes=tuple((a.name, a.nbytes) for a in self.adapters.summaries()),
            merged_lora="" if self.merged_lora is None else self.merged_lora.name,
            spec_method=self.speculate, **(self.speculator.counts() if self.speculator else {}),
            **self._draft_stats(),
        )

    def _draft_stats(self) -> dict[str, Any]:
        """The draft model's name and bytes for EngineStats, where --speculate draft has one."""
        drafter = self.drafter
        if drafter is None or drafter.runner is None:
            return {}
        return {"draft_model": drafter.name, "draft_weights_bytes": drafter.engine.weights_bytes,
                "draft_kv_bytes": drafter.runner.kv_bytes}



def _adapter_order(item: Any) -> tuple[bool, str, float]:
    """Sort key of a scheduled chunk: single-token chunks first (the attention backends read them so), then
    by adapter and scale (the base model's rows, named "", first)."""
    seq = item.seq
    return item.num_new_tokens != 1, "" if seq.lora is None else seq.lora.name, seq.sampling.lora_scale


def _grammar_accepts(seq: Sequence, token_id: int) -> bool:
    """Advance seq's grammar past its sampled token; True once the grammar has ended (at a stop token)."""
    if not seq.grammar.accept(token_id):
        raise RuntimeError(f"token {token_id} was sampled against its grammar's mask")  # a bug, not a user error
    return seq.grammar.is_terminated


def _find_stop(text: str, stops: tuple[str, ...], new_chars: int) -> int | None:
    """The first position of a stop string in text, whose last new_chars characters are new: the text
    before them was searched at earlier tokens, so only a stop that ends in the new part can be found
    (a search from its start on every token would cost the whole text each time)."""
    start = len(text) - new_chars
    positions = [i for i in (text.find(s, max(0, start - len(s) + 1)) for s in stops) if i >= 0]
    return min(positions) if positions else None

