"""One step's LoRA work: which token rows run which adapter, and the low-rank add after each base product.

The base products run once for every row of the step; then each span of rows that share an adapter (and a
scale) adds its adapter's scale * (x @ A.T) @ B.T to those rows. The engine orders a step's sequences so one
adapter's rows lie together (decodes first, then prefill chunks). Short spans (decode rows: a few per
adapter) run together: their rows gathered into [spans, longest span, in] and multiplied by the loaded
adapters' stacked pairs (models/lora_slots.py) in two batched products, the result added back by row index,
so a step of many adapters costs a few operations per product, not a few per adapter. Long spans (a prompt's
chunk) run on their adapter's own pair, on contiguous slices, with no padding. With pagecli's CPU kernels
holding the stacks (AdapterSlots.native), every row instead takes its add from one kernel call per product
(lora_add.h: rows grouped by adapter), and the one-call decode step runs adapter rows too (NativeRows). With
the Triton attention backend (a CUDA device) every adapter row, short span or long, takes its add from two
segmented kernel launches per product (pagecli.kernels.lora: TritonRows); the PyTorch way stays for other
devices and as the reference. The step's LoraBatch is passed down the forward explicitly; no module holds
per-step state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pagecli.models.lora import LoraAdapter
from pagecli.models.lora_slots import PRODUCTS, AdapterSlots

SHORT_SPAN_ROWS = 32  # spans of at most this many rows run batched (padded to the longest); longer ones alone


@dataclass(frozen=True)
class LoraSpan:
    adapter: LoraAdapter
    start: int  # first token row
    end: int  # one past the last
    scale: float  # the requests' lora_scale


@dataclass(frozen=True)
class ShortSpans:
    """The short spans of a step as one padded batch over the adapters' slots."""

    slots: AdapterSlots
    slot_ids: torch.Tensor | None  # [spans]: each span's slot; None when the spans are slots 0.. in order
    rows: torch.Tensor  # [spans * longest] the token row of each padded place (padding repeats a real row)
    scales: torch.Tensor  # [spans, longest, 1] each place's scale, 0 on padding
    num_spans: int
    longest: int


@dataclass(frozen=True)
class NativeRows:
    """Every row of a step for the CPU kernels' adds: its adapter's slot (-1: the base) and scale."""

    stacks: Any  # AdapterSlots.native (ops.LoraStacks)
    row_slot: torch.Tensor  # [num_tokens] int64
    row_scale: torch.Tensor  # [num_tokens] float32


@dataclass(frozen=True)
class TritonRows:
    """Every adapter row of a step for the Triton kernels: tiles of one span each over the slots' stacks."""

    slots: AdapterSlots
    tiles: Any  # pagecli.kernels.lora.LoraTiles (imported with triton, on the Triton path only)


_PRODUCT_INDEX = {product: index for index, product in enumerate(PRODUCTS)}


@dataclass(frozen=True)
class LoraBatch:
    spans: tuple[LoraSpan, ...]  # the long spans, each on its own adapter's pair
    short: ShortSpans | None = None
    native: NativeRows | None = None  # set: the CPU kernels add every row (spans and short are then empty)
    triton: TritonRows | None = None  # set: the Triton kernels add every row (the others are then empty)

    @staticmethod
    def from_rows(rows: Iterable[tuple[LoraAdapter | None, float, int]], slots: AdapterSlots | None = None,
                  device: torch.device | None = None) -> LoraBatch | None:
        """From each scheduled chunk's (adapter or None, scale, tokens) in row order: one span per run of chunks
        with one adapter and scale. None when no row runs an adapter (the base model's own fast paths run).
        slots: the loaded adapters' stacks (None: every span runs alone)."""
        spans: list[LoraSpan] = []
        start = 0
        for adapter, scale, num_tokens in rows:
            end = start + num_tokens
            if adapter is not None and scale != 0:
                last = spans[-1] if spans else None
                if last is not None and last.adapter is adapter and last.scale == scale and last.end == start:
                    spans[-1] = LoraSpan(adapter, last.start, end, scale)
                else:
                    spans.append(LoraSpan(adapter, start, end, scale))
            start = end
        if not spans:
            return None
        every_span_loaded = slots is not None and all(id(span.adapter) in slots.slot_of for span in spans)
        if every_span_loaded and slots.native is not None:
            return LoraBatch((), None, _native_rows(spans, start, slots, device))
        if every_span_loaded and slots.triton:
            return LoraBatch((), triton=_triton_rows(spans, slots, device))
        if slots is None:
            return LoraBatch(tuple(spans))
        is_short = [span.end - span.start <= SHORT_SPAN_ROWS and id(span.adapter) in slots.slot_of for span in spans]
        if sum(is_short) < 2:  # one span alone is as fast on its own pair
            return LoraBatch(tuple(spans))
        long = tuple(span for span, short in zip(spans, is_short) if not short)
        return LoraBatch(long, _short_spans([span for span, short in zip(spans, is_short) if short], slots, device))

    def add(self, layer: int, product: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[rows] += scale * (x[rows] @ A.T) @ B.T for each span whose adapter targets this product.
        x: [num_tokens, in_features], out: [num_tokens, out_features], changed in place and returned."""
        if self.native is not None:
            self.native.stacks.add(layer, _PRODUCT_INDEX[product], x, out, self.native.row_slot, self.native.row_scale)
            return out
        if self.triton is not None:
            return self._add_triton(layer, product, x, out)
        for span in self.spans:
            pair = span.adapter.layers[layer].get(product)
            if pair is None:
                continue
            rows = x[span.start:span.end]
            down = rows @ pair.a.T  # [span rows, rank]
            out[span.start:span.end].addmm_(down, pair.b.T, alpha=span.scale)
        if self.short is not None:
            self._add_short(layer, product, x, out)
        return out

    def _add_short(self, layer: int, product: str, x: torch.Tensor, out: torch.Tensor) -> None:
        short = self.short
        stack = short.slots.stacks[layer].get(product)
        if stack is None:
            return
        a, b = stack  # [slots, rank, in], [slots, rank, out]
        if short.slot_ids is not None:
            a, b = a.index_select(0, short.slot_ids), b.index_select(0, short.slot_ids)
        gathered = x.index_select(0, short.rows).view(short.num_spans, short.longest, x.shape[1])
        down = torch.bmm(gathered, a.transpose(1, 2)) * short.scales  # [spans, longest, rank]
        delta = torch.bmm(down, b)  # [spans, longest, out]
        out.index_add_(0, short.rows, delta.view(-1, out.shape[1]))

    def _add_triton(self, layer: int, product: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        from pagecli.kernels.lora import lora_add

        stack = self.triton.slots.stacks[layer].get(product)
        if stack is None:  # no loaded adapter targets this product in this layer
            return out
        return lora_add(out, x, stack[0], stack[1], self.triton.tiles)


def _triton_rows(spans: list[LoraSpan], slots: AdapterSlots, device: torch.device | None) -> TritonRows:
    from pagecli.kernels.lora import lora_tiles

    segments = [(span.start, span.end, slots.slot_of[id(span.adapter)], span.scale) for span in spans]
    return TritonRows(slots, lora_tiles(segments, slots.dtype, device))


def _native_rows(spans: list[LoraSpan], num_tokens: int, slots: AdapterSlots,
                 device: torch.device | None) -> NativeRows:
    row_slot = [-1] * num_tokens
    row_scale = [0.0] * num_tokens
    for span in spans:
        slot = slots.slot_of[id(span.adapter)]
        row_slot[span.start:span.end] = [slot] * (span.end - span.start)
        row_scale[span.start:span.end] = [span.scale] * (span.end - span.start)
    return NativeRows(slots.native, torch.tensor(row_slot, dtype=torch.long, device=device),
                      torch.tensor(row_scale, dtype=torch.float32, device=device))


def _short_spans(short: list[LoraSpan], slots: AdapterSlots, device: torch.device | None) -> ShortSpans:
    longest = max(span.end - span.start for span in short)
    rows: list[int] = []
    scales: list[float] = []
    for span in short:
        n = span.end - span.start
        rows += list(range(span.start, span.end)) + [span.start] * (longest - n)
        scales += [span.scale] * n + [0.0] * (longest - n)
    slot_ids = [slots.slot_of[id(span.adapter)] for span in short]
    in_order = slot_ids == list(range(len(slots.slot_of)))
    return ShortSpans(
        slots, None if in_order else torch.tensor(slot_ids, dtype=torch.long, device=device),
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(scales, dtype=slots.dtype, device=device).view(len(short), longest, 1), len(short), longest)


@dataclass(frozen=True)
class LayerLora:
    """A LoraBatch seen from one decoder layer (what Attention and GatedMLP take)."""

    batch: LoraBatch
    layer: int

    def add(self, product: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.batch.add(self.layer, product, x, out)
