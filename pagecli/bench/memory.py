"""The analytic memory model behind `pagecli bench memory`: contiguous reservation versus paging.

Pure arithmetic on request lengths, no model run. A "slot" holds one token's K and V for every
layer. Contiguous reservation gives each request `max_len` slots up front; paging gives it
ceil(length / block_size) blocks, so its waste is the unused tail of the last block:
at most block_size - 1 slots per request, whatever max_len is. A prefix shared by every
request is stored once, but only in whole blocks: the engine shares full blocks only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagecli.bench.units import MAX_SIZE_BYTES
from pagecli.errors import PagecliError

MAX_TOKENS = 1 << 40  # beyond any model's context; keeps every byte figure within a float's range


def blocks_for(length: int, block_size: int) -> int:
    """Blocks a sequence of `length` tokens occupies (the last one possibly partial)."""
    return -(-length // block_size)


@dataclass(frozen=True)
class RequestMemory:
    """One request under both schemes, in slots, for one block size."""

    length: int
    contiguous_reserved_slots: int
    contiguous_wasted_slots: int
    paged_blocks: int
    paged_allocated_slots: int
    paged_wasted_slots: int


@dataclass(frozen=True)
class PagedTotals:
    """All requests under paging with one block size; bytes and fits are None without KV sizes."""

    block_size: int
    requests: tuple[RequestMemory, ...]
    blocks: int
    allocated_slots: int
    wasted_slots: int
    waste_bound_slots: int  # (block_size - 1) per request: paging can never waste more
    shared_prefix_blocks: int  # full blocks of the shared prefix, stored once instead of per request
    blocks_saved_by_sharing: int
    blocks_with_sharing: int
    kv_bytes_per_block: int | None
    allocated_bytes: int | None
    bytes_with_sharing: int | None  # the shared prefix's full blocks stored once
    requests_fit: int | None  # this request mix, taken in order and repeated, under the budget

    @property
    def waste_share(self) -> float:
        """Wasted slots as a share of the slots paging allocated."""
        return self.wasted_slots / self.allocated_slots if self.allocated_slots else 0.0


@dataclass(frozen=True)
class ContiguousTotals:
    reserved_slots: int
    wasted_slots: int
    reserved_bytes: int | None
    requests_fit: int | None  # max_len reservations that fit in the budget

    @property
    def waste_share(self) -> float:
        """Wasted slots as a share of the slots reserved."""
        return self.wasted_slots / self.reserved_slots if self.reserved_slots else 0.0


@dataclass(frozen=True)
class MemoryReport:
    lengths: tuple[int, ...]
    max_len: int
    shared_prefix_tokens: int
    kv_bytes_per_token: int | None
    budget_bytes: int | None
    contiguous: ContiguousTotals
    paged: tuple[PagedTotals, ...]  # one per block size, in the order asked for

    @property
    def num_requests(self) -> int:
        return len(self.lengths)


def request_memory(length: int, max_len: int, block_size: int) -> RequestMemory:
    blocks = blocks_for(length, block_size)
    return RequestMemory(
        length=length,
        contiguous_reserved_slots=max_len,
        contiguous_wasted_slots=max_len - length,
        paged_blocks=blocks,
        paged_allocated_slots=blocks * block_size,
        paged_wasted_slots=blocks * block_size - length,
    )


def paged_requests_fit(lengths: Sequence[int], block_size: int, pool_blocks: int, shared_prefix_tokens: int = 0) -> int:
    """How many requests fit at once in `pool_blocks` blocks, taking `lengths` in order and repeating it.

    The shared prefix's full blocks are stored once (and must fit first); each request then
    needs only its own blocks.
    """
    prefix_blocks = shared_prefix_tokens // block_size
    own_blocks = [blocks_for(n, block_size) - prefix_blocks for n in lengths]
    available = pool_blocks - prefix_blocks
    if available <= 0 or not own_blocks:
        return 0
    full_rounds, available = divmod(available, sum(own_blocks))
    fit = full_rounds * len(own_blocks)
    for need in own_blocks:
        if need > available:
            break
        available -= need
        fit += 1
    return fit


def paged_totals(lengths: Sequence[int], max_len: int, block_size: int, shared_prefix_tokens: int = 0,
                 kv_bytes_per_token: int | None = None, budget_bytes: int | None = None) -> PagedTotals:
    requests = tuple(request_memory(n, max_len, block_size) for n in lengths)
    blocks = sum(r.paged_blocks for r in requests)
    prefix_blocks = shared_prefix_tokens // block_size
    saved = prefix_blocks * max(len(requests) - 1, 0)
    bytes_per_block = kv_bytes_per_token * block_size if kv_bytes_per_token is not None else None
    fit = None
    if bytes_per_block is not None and budget_bytes is not None:
        fit = paged_requests_fit(lengths, block_size, budget_bytes // bytes_per_block, shared_prefix_tokens)
    return PagedTotals(
        block_size=block_size,
        requests=requests,
        blocks=blocks,
        allocated_slots=blocks * block_size,
        wasted_slots=sum(r.paged_wasted_slots for r in requests),
        waste_bound_slots=(block_size - 1) * len(requests),
        shared_prefix_blocks=prefix_blocks,
        blocks_saved_by_sharing=saved,
        blocks_with_sharing=blocks - saved,
        kv_bytes_per_block=bytes_per_block,
        allocated_bytes=blocks * bytes_per_block if bytes_per_block is not None else None,
        bytes_with_sharing=(blocks - saved) * bytes_per_block if bytes_per_block is not None else None,
        requests_fit=fit,
    )


def contiguous_totals(lengths: Sequence[int], max_len: int, kv_bytes_per_token: int | None = None,
                      budget_bytes: int | None = None) -> ContiguousTotals:
    reserved = max_len * len(lengths)
    per_request_bytes = max_len * kv_bytes_per_token if kv_bytes_per_token is not None else None
    return ContiguousTotals(
        reserved_slots=reserved,
        wasted_slots=reserved - sum(lengths),
        reserved_bytes=reserved * kv_bytes_per_token if kv_bytes_per_token is not None else None,
        requests_fit=budget_bytes // per_request_bytes if per_request_bytes and budget_bytes is not None else None,
    )


def memory_report(lengths: Sequence[int], max_len: int, block_sizes: Sequence[int], shared_prefix_tokens: int = 0,
                  kv_bytes_per_token: int | None = None, budget_bytes: int | None = None) -> MemoryReport:
    """Both schemes for every block size; raises PagecliError on inputs that cannot describe requests."""
    _validate(lengths, max_len, block_sizes, shared_prefix_tokens, kv_bytes_per_token, budget_bytes)
    return MemoryReport(
        lengths=tuple(lengths),
        max_len=max_len,
        shared_prefix_tokens=shared_prefix_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        budget_bytes=budget_bytes,
        contiguous=contiguous_totals(lengths, max_len, kv_bytes_per_token, budget_bytes),
        paged=tuple(
            paged_totals(lengths, max_len, bs, shared_prefix_tokens, kv_bytes_per_token, budget_bytes)
            for bs in block_sizes
        ),
    )


def _validate(lengths: Sequence[int], max_len: int, block_sizes: Sequence[int], shared_prefix_tokens: int,
              kv_bytes_per_token: int | None, budget_bytes: int | None) -> None:
    if not lengths:
        raise PagecliError("No request lengths were given.")
    if not 1 <= max_len <= MAX_TOKENS:
        raise PagecliError(f"--max-len must be between 1 and {MAX_TOKENS:,} tokens (got {max_len}).")
    if not block_sizes or not 1 <= min(block_sizes) <= max(block_sizes) <= MAX_TOKENS:
        raise PagecliError(f"Every block size must be between 1 and {MAX_TOKENS:,} tokens.")
    if min(lengths) < 1:
        raise PagecliError(f"Request lengths must be at least 1 token (got {min(lengths)}).")
    if max(lengths) > max_len:
        raise PagecliError(
            f"A request of {max(lengths)} tokens does not fit --max-len {max_len}; raise --max-len or shorten it."
        )
    if shared_prefix_tokens < 0:
        raise PagecliError("--shared-prefix must be 0 or more tokens.")
    if shared_prefix_tokens and min(lengths) <= shared_prefix_tokens:
        raise PagecliError(
            f"Every request must be longer than the shared prefix of {shared_prefix_tokens} tokens "
            f"(the shortest has {min(lengths)})."
        )
    if kv_bytes_per_token is not None and not 1 <= kv_bytes_per_token <= MAX_SIZE_BYTES:
        raise PagecliError(f"KV bytes per token must be between 1 and {MAX_SIZE_BYTES:,} (got {kv_bytes_per_token}).")
    if budget_bytes is not None and kv_bytes_per_token is None:
        raise PagecliError("A budget needs the KV size of a token: name a --model or give --kv-bytes-per-token.")
