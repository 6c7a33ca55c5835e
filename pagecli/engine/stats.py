"""The one stats snapshot: the chat panel, `bench`, `/stats` and JSON output all read this."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

# A block's state as one letter: GET /v1/pool's block_map (pagecli/serve/pool_view.py), read back by clients.
BLOCK_LETTERS = {"free": ".", "cached": "c", "active": "a", "shared": "s"}
_STATE_OF_LETTER = {letter: state for state, letter in BLOCK_LETTERS.items()}


@dataclass(frozen=True)
class EngineStats:
    # Pool geometry and memory.
    block_size: int
    num_blocks: int
    kv_bytes_per_block: int
    kv_bytes_total: int
    weights_bytes: int
    # Pool occupancy: every block is exactly one of free / cached / active (shared is a subset of active).
    blocks_free: int
    blocks_cached: int
    blocks_active: int
    blocks_shared: int
    # Scheduler.
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_steps: int
    # Work done, in tokens.
    prompt_tokens_computed: int
    tokens_generated: int
    # Prefix cache, in tokens: what new requests asked for and what the tiers served.
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_disk_hit_tokens: int
    evictions: int
    # Where it runs.
    device: str
    dtype: str
    attention_backend: str
    max_model_len: int
    # Forks (n > 1): block references candidates took instead of their own blocks, and the copies
    # copy-on-write made later; their difference is the blocks sharing saved (blocks_saved_by_sharing).
    fork_block_shares: int = 0
    cow_block_copies: int = 0
    block_references: int = 0  # block-table entries of running sequences (a shared block counts once per holder)
    slots_unused: int = 0  # slots of running sequences' blocks that hold no token yet: internal fragmentation
    block_states: tuple[str, ...] | None = None  # per block: free/cached/active/shared, when asked for
    kv_dtype: str = ""  # the KV cache's format (--kv-dtype resolved: the model's dtype, or int8/fp8/...)
    quantize: str = "none"  # the decoder weights' form (--quantize resolved: none, int8, int4, gguf)
    weight_forms: str = ""  # how the weights are kept, in a few words (models.weight_plan.WeightPlan.summary)
    # Speculative decoding (engine/speculation.py): drafts checked and accepted, sequence-steps that checked
    # drafts and the tokens those steps yielded (tokens per pass = spec_tokens / spec_passes).
    spec_method: str = ""  # --speculate resolved: off, ngram or draft
    spec_drafts: int = 0
    spec_accepted: int = 0
    spec_passes: int = 0
    spec_tokens: int = 0
    # --speculate draft's model: its name, weights and KV pool (as many blocks as the main pool, out of the same
    # budget: engine/draft_model.py); empty and 0 without one.
    draft_model: str = ""
    draft_weights_bytes: int = 0
    draft_kv_bytes: int = 0

    @property
    def spec_acceptance(self) -> float:
        return self.spec_accepted / self.spec_drafts if self.spec_drafts else 0.0
    # LoRA adapters (--lora): bytes of those in memory, and the most they may hold (the --max-loras largest);
    # per adapter, the requests added so far and the pool blocks that hold its prefixes (active or cached), as
    # (name, count) pairs; the base model's are not listed.
    adapter_bytes: int = 0
    adapter_budget_bytes: int = 0
    adapter_requests: tuple[tuple[str, int], ...] = ()
    adapter_blocks: tuple[tuple[str, int], ...] = ()
    adapter_sizes: tuple[tuple[str, int], ...] = ()  # (name, bytes of its pairs once loaded) per --lora adapter
    merged_lora: str = ""  # the adapter merged into the weights (--merge-lora), "" for none

    @property
    def kv_bytes_used(self) -> int:
        """Bytes of blocks that hold something (active or cached)."""
        return (self.blocks_active + self.blocks_cached) * self.kv_bytes_per_block

    @property
    def tokens_that_fit(self) -> int:
        """Tokens the pool can still take: free blocks plus cached blocks that may be evicted."""
        return (self.blocks_free + self.blocks_cached) * self.block_size

    @property
    def blocks_saved_by_sharing(self) -> int:
        """Blocks the candidates of n > 1 requests would have taken as separate copies, minus those taken."""
        return self.fork_block_shares - self.cow_block_copies

    @property
    def prefix_hit_rate(self) -> float:
        hits = self.prefix_hit_tokens + self.prefix_disk_hit_tokens
        return hits / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def block_map(self) -> str | None:
        """Each block's state as one letter (BLOCK_LETTERS), in block order; None without block states."""
        return None if self.block_states is None else "".join(BLOCK_LETTERS[s] for s in self.block_states)

    @classmethod
    def from_dict(cls, data: dict[str, Any], block_map: str | None = None) -> EngineStats:
        """The snapshot that to_dict (and block_map) wrote, read back: how a client of `pagecli serve` gets
        the engine's own stats from GET /v1/pool and draws the panel `pagecli chat` draws."""
        names = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in names}
        values["block_states"] = None if block_map is None else tuple(_STATE_OF_LETTER[c] for c in block_map)
        for key in ("adapter_requests", "adapter_blocks", "adapter_sizes"):  # JSON gives lists of [name, count]
            if key in values:
                values[key] = tuple((str(name), int(count)) for name, count in values[key])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("block_states")
        data.update(kv_bytes_used=self.kv_bytes_used, tokens_that_fit=self.tokens_that_fit,
                    blocks_saved_by_sharing=self.blocks_saved_by_sharing,
                    prefix_hit_rate=round(self.prefix_hit_rate, 6), spec_acceptance=round(self.spec_acceptance, 6))
        return data
