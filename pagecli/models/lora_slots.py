"""Every loaded LoRA adapter's pairs stacked into one tensor per layer and product, so the short spans of a
step (decode rows) of all its adapters run as two batched products per product and layer, not two per adapter.

Slot s holds the s-th loaded adapter; each product's stack is padded with zeros to the largest rank a loaded
adapter has there (a zero row of A and column of B add nothing), and an adapter that does not target a product
has zeros there. The stacks are rebuilt when the set of loaded adapters changes (a load, or one dropped for
room): rare, and a copy of the adapters' own bytes. With pagecli's CPU kernels (float32, bf16 or fp16
activations: the stacks stay in the model's dtype, the kernel sums in float32) the stacks are also handed to
them once (`native`, lora_add.h): then every adapter row of a step, decode or
prompt, in the one-call decode step or the Python layer loop, gets its low-rank add from one kernel whose
sums run in one order per row, so a request's bits do not depend on the batch it runs in. With the Triton
attention backend (`triton`) the same stacks feed the segmented Triton kernels (pagecli.kernels.lora), which
add every adapter row of a step in two launches per product.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagecli.models.lora import PRODUCTS, LoraAdapter

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes pagecli's lora_add_ takes


class AdapterSlots:
    """ops: pagecli's CPU kernels (None: PyTorch's operations add every row); triton: the Triton kernels add
    every row (the engine runs the Triton attention backend: on CUDA, or interpreted in tests)."""

    def __init__(self, ops: Any = None, triton: bool = False) -> None:
        self.ops = None if triton else ops
        self.triton = triton
        self.slot_of: dict[int, int] = {}  # id(adapter) -> its slot
        # Per layer, product -> (a [slots, rank, in], b [slots, rank, out]).
        self.stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        self._adapters: tuple[LoraAdapter, ...] = ()
        self.dtype = torch.float32  # the adapters' (the model's activations')
        self.native: Any = None  # the stacks as the CPU kernels hold them (ops.LoraStacks), where they run them

    def rebuild(self, adapters: Sequence[LoraAdapter]) -> None:
        self._adapters = tuple(adapters)
        self.slot_of = {id(adapter): slot for slot, adapter in enumerate(self._adapters)}
        self.stacks = []
        self.native = None
        if not self._adapters:
            return
        for layer in range(len(self._adapters[0].layers)):
            products = {product for adapter in self._adapters for product in adapter.layers[layer]}
            self.stacks.append({product: self._stack(layer, product) for product in sorted(products)})
        self.dtype = next(a.dtype for layer in self.stacks for a, _ in layer.values())
        device = next(a.device for layer in self.stacks for a, _ in layer.values())
        if self.ops is not None and self.dtype in NATIVE_DTYPES and device.type == "cpu":
            self.native = self.ops.LoraStacks([[t for product in PRODUCTS for t in layer.get(product, (None, None))]
                                               for layer in self.stacks])

    def _stack(self, layer: int, product: str) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [adapter.layers[layer].get(product) for adapter in self._adapters]
        some = next(pair for pair in pairs if pair is not None)
        rank = max(pair.a.shape[0] for pair in pairs if pair is not None)
        in_features, out_features = some.a.shape[1], some.b.shape[0]
        a = some.a.new_zeros(len(pairs), rank, in_features)  # [slots, rank, in]
        b = some.b.new_zeros(len(pairs), rank, out_features)  # [slots, rank, out]
        for slot, pair in enumerate(pairs):
            if pair is not None:
                r = pair.a.shape[0]
                a[slot, :r, :] = pair.a
                b[slot, :r, :] = pair.b.T
        return a, b
