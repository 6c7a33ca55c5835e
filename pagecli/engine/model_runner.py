"""Runs one scheduled step through the model: flat batch in, logits of the sampled positions out.

Owns the KV pool tensor: [num_layers, 2, num_blocks, block_size, kv_heads, row] (row: head_dim, or
head_dim + 2 scale bytes for a quantized cache; pagecli/kv_format.py),
allocated once. No padding: the batch is the concatenation of every scheduled chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagecli.attention import AttentionBackend, AttentionMetadata
from pagecli.attention.metadata import host_tensor
from pagecli.kv_format import KVFormat, resolve_kv_format
from pagecli.engine.block_tables import KeptBlockTables
from pagecli.engine.scheduler import ScheduledSeq
from pagecli.models.loader import LoadedModel
from pagecli.models.lora_batch import LoraBatch
from pagecli.models.lora_slots import AdapterSlots


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampled] rows of the hidden states whose logits are needed
    lora: LoraBatch | None = None  # which rows run which LoRA adapter (None: all the base model)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, backend: AttentionBackend, num_blocks: int, block_size: int,
                 kv_format: KVFormat | None = None, lora_slots: AdapterSlots | None = None) -> None:
        self.loaded = loaded
        self.lora_slots = lora_slots  # the loaded LoRA adapters stacked (engine/adapters.py), when there are any
        self.backend = backend
        self.block_size = block_size
        self.block_tables = KeptBlockTables(loaded.device)
        spec = loaded.spec
        fmt = kv_format or resolve_kv_format("auto", loaded.dtype, spec.head_dim)
        # [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim (+ 2 scale bytes when quantized:
        # kv_format.py)]. Not zeroed: a slot is written before anything reads it, and untouched pages of a
        # large pool cost no memory.
        self.kv_caches = torch.empty(
            spec.num_layers, 2, *fmt.cache_shape(num_blocks, block_size, spec.num_kv_heads),
            dtype=fmt.storage_dtype, device=loaded.device,
        )

    @property
    def kv_bytes(self) -> int:
        return self.kv_caches.numel() * self.kv_caches.element_size()

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_indices: list[int] = []
        bs = self.block_size
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            table = seq.block_table
            if n == 1:  # a decode token (the most common chunk): no ranges
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start : start + n])
                positions.extend(range(start, start + n))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            if item.samples:
                if seq.num_draft:  # a speculative chunk: every position's logits are checked
                    sample_indices.extend(range(len(input_ids) - n, len(input_ids)))
                else:
                    sample_indices.append(len(input_ids) - 1)
        device = self.loaded.device
        num_decode = sum(1 for q in query_lens if q == 1)
        tables = self.block_tables.gather([item.seq for item in scheduled])  # [num_seqs, max_blocks]
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, num_decode, device)
        return StepInputs(
            input_ids=host_tensor(input_ids, torch.int64, device),
            positions=host_tensor(positions, torch.int64, device),
            meta=meta,
            sample_indices=host_tensor(sample_indices, torch.int64, device),
            lora=None if self.lora_slots is None and all(item.seq.lora is None for item in scheduled) else
            LoraBatch.from_rows(((item.seq.lora, item.seq.sampling.lora_scale, item.num_new_tokens)
                                 for item in scheduled), self.lora_slots, device),
        )

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward one step; returns logits [num_sampled, vocab] in scheduled order and, with greedy, each
        row's greedy choice [num_sampled] where the output layer took it as it wrote them (else None)."""
        inputs = self.prepare(scheduled)
        hidden = self.loaded.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend,
                                   inputs.lora)
        # The indices increase, so as many as there are rows means every row (a decode step): no gather.
        if inputs.sample_indices.numel() != hidden.shape[0]:
            hidden = hidden[inputs.sample_indices]
        return self.loaded.model.logits_and_greedy(hidden, greedy)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Run copy-on-write copies, (source, destination) block ids, before the step that writes them."""
        if copies:
            self.backend.copy_blocks(self.kv_caches, [s for s, _ in copies], [d for _, d in copies])

    def copy_blocks_out(self, block_ids: list[int]) -> torch.Tensor:
        """K/V of some blocks, all layers: [num_layers, 2, len(block_ids), block_size, kv_heads, row], as stored."""
        return self.kv_caches[:, :, block_ids].cpu()

    def copy_blocks_in(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.kv_caches[:, :, block_ids] = data.to(self.kv_caches.device, self.kv_caches.dtype)
