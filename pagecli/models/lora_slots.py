"""Every loaded LoRA adapter's pairs stacked into one tensor per layer and product, so the short spans of a
step (decode rows) of all its adapters run as two batched products per product and layer, not two per adapter.

Slot s holds the s-th loaded adapter; each product's stack is padded with zeros to the largest rank a loaded
adapter has there (a zero row of A and column of B add nothing), and an adapter that does not target a product
has zeros there. The stacks are rebuilt when the set of loaded adapters changes (a load, or one dropped for
room): rare, and a copy of the adapters' own bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagecli.models.lora import LoraAdapter


class AdapterSlots:
    def __init__(self) -> None:
        self.slot_of: dict[int, int] = {}  # id(adapter) -> its slot
        # Per layer, product -> (a [slots, in, rank], b [slots, rank, out]): pre-transposed for torch.bmm.
        self.stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        self._adapters: tuple[LoraAdapter, ...] = ()
        self.dtype = torch.float32  # the adapters' (the model's activations')

    def rebuild(self, adapters: Sequence[LoraAdapter]) -> None:
        self._adapters = tuple(adapters)
        self.slot_of = {id(adapter): slot for slot, adapter in enumerate(self._adapters)}
        self.stacks = []
        if not self._adapters:
            return
        for layer in range(len(self._adapters[0].layers)):
            products = {product for adapter in self._adapters for product in adapter.layers[layer]}
            self.stacks.append({product: self._stack(layer, product) for product in sorted(products)})
        self.dtype = next(a.dtype for layer in self.stacks for a, _ in layer.values())

    def _stack(self, layer: int, product: str) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [adapter.layers[layer].get(product) for adapter in self._adapters]
        some = next(pair for pair in pairs if pair is not None)
        rank = max(pair.a.shape[0] for pair in pairs if pair is not None)
        in_features, out_features = some.a.shape[1], some.b.shape[0]
        a = some.a.new_zeros(len(pairs), in_features, rank)  # [slots, in, rank]
        b = some.b.new_zeros(len(pairs), rank, out_features)  # [slots, rank, out]
        for slot, pair in enumerate(pairs):
            if pair is not None:
                r = pair.a.shape[0]
                a[slot, :, :r] = pair.a.T
                b[slot, :r, :] = pair.b.T
        return a, b
