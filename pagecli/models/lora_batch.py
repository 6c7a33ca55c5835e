"""One step's LoRA work: which token rows run which adapter, and the low-rank add after each base product.

The base products run once for every row of the step; then each span of rows that share an adapter (and a
scale) adds its adapter's (x @ A.T) @ B.T to those rows. The engine orders a step's sequences so one
adapter's rows lie together (decodes first, then prefill chunks: at most two spans per adapter), so the
adds are two small matrix products per span and product, on contiguous slices. The step's LoraBatch is
passed down the forward explicitly; no module holds per-step state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagecli.models.lora import LoraAdapter


@dataclass(frozen=True)
class LoraSpan:
    adapter: LoraAdapter
    start: int  # first token row
    end: int  # one past the last
    scale: float  # the requests' lora_scale


@dataclass(frozen=True)
class LoraBatch:
    spans: tuple[LoraSpan, ...]

    @staticmethod
    def from_rows(rows: Iterable[tuple[LoraAdapter | None, float, int]]) -> LoraBatch | None:
        """From each scheduled chunk's (adapter or None, scale, tokens) in row order: one span per run of chunks
        with one adapter and scale. None when no row runs an adapter (the base model's own fast paths run)."""
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
        return LoraBatch(tuple(spans)) if spans else None

    def add(self, layer: int, product: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[rows] += scale * (x[rows] @ A.T) @ B.T for each span whose adapter targets this product.
        x: [num_tokens, in_features], out: [num_tokens, out_features], changed in place and returned."""
        for span in self.spans:
            pair = span.adapter.layers[layer].get(product)
            if pair is None:
                continue
            rows = x[span.start:span.end]
            down = rows @ pair.a.T  # [span rows, rank]
            out[span.start:span.end].addmm_(down, pair.b.T, alpha=span.scale)
        return out


@dataclass(frozen=True)
class LayerLora:
    """A LoraBatch seen from one decoder layer (what Attention and GatedMLP take)."""

    batch: LoraBatch
    layer: int

    def add(self, product: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.batch.add(self.layer, product, x, out)
