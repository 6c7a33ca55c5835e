"""The engine's LoRA adapters: the names it was given, checked at start, loaded on first use, at most
`max_loras` in memory at once.

Every adapter is checked at start-up against the base model (models/lora.inspect_adapter reads only its
config and safetensors header), so a mismatched one stops the engine with one sentence before any request.
Its weights load when a request first names it. With the budget full, the least recently used adapter that
no unfinished sequence runs is dropped to make room; when every loaded adapter is in use, the new request is
refused (RequestError) and may be sent again once one finishes.

Each adapter's prefix-cache chains root in (model fingerprint, the adapter's content hash): two adapters,
or an adapter and the base, never share a block, in the pool or in the disk store.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pagecli.engine.hashing import root_hash
from pagecli.errors import RequestError
from pagecli.models.lora import AdapterInfo, LoraAdapter, adapter_bytes, inspect_adapter, load_adapter
from pagecli.models.lora_slots import AdapterSlots
from pagecli.models.spec import DecoderSpec


@dataclass(frozen=True)
class AdapterSummary:
    """One adapter as `pagecli models`, /v1/models and the start-up line show it."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    nbytes: int  # what it holds in memory once loaded
    loaded: bool


def adapter_fingerprint(model_fingerprint: str, content_hash: str) -> str:
    """The fingerprint of prefixes computed under an adapter: the model's, plus the adapter's content."""
    return f"{model_fingerprint}|lora={content_hash}"


class AdapterRegistry:
    def __init__(self, pairs: Iterable[tuple[str, str]], spec: DecoderSpec, dtype: torch.dtype, device: torch.device,
                 max_loras: int, max_rank: int, model_fingerprint: str, ops: Any = None, triton: bool = False) -> None:
        """ops: pagecli's CPU kernels, which then add the adapters' rows (models/lora_slots.AdapterSlots);
        triton: the Triton kernels add them instead (the engine's attention backend is Triton's)."""
        self.spec, self.dtype, self.device = spec, dtype, device
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.model_fingerprint = model_fingerprint
        self.infos: dict[str, AdapterInfo] = {}
        for name, path in pairs:
            self.register(name, path)
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.slots = AdapterSlots(ops, triton)  # the loaded adapters stacked, for a step's rows of many adapters
        self.loads = 0

    def register(self, name: str, path: str) -> AdapterInfo:
        """Check the adapter at path and make it nameable (ModelError, one sentence, if it does not fit)."""
        info = inspect_adapter(name, path, self.spec, self.max_rank)
        self.infos[name] = info
        return info

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.infos)

    def root_hash(self, name: str) -> bytes:
        return root_hash(adapter_fingerprint(self.model_fingerprint, self.infos[name].content_hash))

    def get(self, name: str, in_use: set[str]) -> LoraAdapter:
        """The named adapter, loaded now if it is not in memory; in_use: adapters unfinished sequences run."""
        if name not in self.infos:
            known = ", ".join(self.infos) or "none (start with --lora NAME=PATH)"
            raise RequestError(f"No LoRA adapter named '{name}'; this engine has: {known}.")
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
            return adapter
        if len(self._loaded) >= self.max_loras:
            idle = next((loaded for loaded in self._loaded if loaded not in in_use), None)
            if idle is None:
                raise RequestError(f"All {self.max_loras} LoRA adapter slots are in use by running requests; send "
                                   f"'{name}' again when one finishes, or raise --max-loras.")
            del self._loaded[idle]
        adapter = load_adapter(self.infos[name], self.spec, self.dtype, self.device)
        self._loaded[name] = adapter
        self.slots.rebuild(list(self._loaded.values()))
        self.loads += 1
        return adapter

    @property
    def stacked_bytes(self) -> int:
        """The stacks' copy of the loaded adapters (padded to each product's largest rank)."""
        return sum(t.numel() * t.element_size() for layer in self.slots.stacks for pair in layer.values() for t in pair)

    def summaries(self) -> tuple[AdapterSummary, ...]:
        return tuple(AdapterSummary(name, str(info.folder), info.rank, info.targets,
                                    adapter_bytes(info, self.spec, self.dtype), name in self._loaded)
                     for name, info in self.infos.items())

    @property
    def loaded_bytes(self) -> int:
        return sum(adapter.nbytes for adapter in self._loaded.values()) + self.stacked_bytes

    @property
    def budget_bytes(self) -> int:
        """About the most adapter bytes memory holds: the max_loras largest adapters, twice (their own pairs, and
        their copy in the stacks that batch their decode rows)."""
        sizes = sorted((s.nbytes for s in self.summaries()), reverse=True)
        return 2 * sum(sizes[: self.max_loras])
