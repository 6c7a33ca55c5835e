"""Ahead-of-time compile of the segmented LoRA kernels (pagecli.kernels.lora) for NVIDIA targets, on a machine
without a GPU: `python -m pagecli.attention.aot_lora [--arch 80,86,89,90] [--sample] [--json] [--list]`.

The sibling of `python -m pagecli.attention.aot` (whose compile, ptxas report and checks it shares): each case
(a supported model's hidden sizes, an adapter rank, a dtype, a step layout) calls the real `lora_add` on meta
tensors for each of the decoder's four products (models/lora_slots.PRODUCTS: the fused qkv_proj holds three
targets' ranks, gate_up_proj two), with the launches intercepted, so every specialization compiled is one the
engine launches. Exit status 1 when a compile fails, a kernel spills, or its shared memory is over the limit.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

from pagecli.attention import aot


@dataclass(frozen=True)
class LoraModelShape:
    """What the LoRA products of one supported model see: its hidden and MLP sizes, and its q and k/v widths."""

    name: str
    hidden: int
    intermediate: int
    q_width: int  # heads * head_dim: o_proj's input
    kv_width: int  # kv_heads * head_dim

    def products(self, rank: int) -> tuple[tuple[str, int, int, int], ...]:
        """(product, in_features, out_features, stacked rank) for an adapter of this rank on every target."""
        return (("qkv_proj", self.hidden, self.q_width + 2 * self.kv_width, 3 * rank),
                ("o_proj", self.q_width, self.hidden, rank),
                ("gate_up_proj", self.hidden, 2 * self.intermediate, 2 * rank),
                ("down_proj", self.intermediate, self.hidden, rank))


LORA_MODEL_SHAPES = (
    LoraModelShape("SmolLM2-135M", 576, 1536, 576, 192),
    LoraModelShape("SmolLM2-360M", 960, 2560, 960, 320),
    LoraModelShape("SmolLM2-1.7B", 2048, 8192, 2048, 2048),
    LoraModelShape("Llama-3.2-1B", 2048, 8192, 2048, 512),
    LoraModelShape("Llama-3.2-3B", 3072, 8192, 3072, 1024),
    LoraModelShape("Llama-2-7B", 4096, 11008, 4096, 4096),
    LoraModelShape("Llama-3.1-8B/Mistral-7B", 4096, 14336, 4096, 1024),
    LoraModelShape("Llama-3.1-70B", 8192, 28672, 8192, 1024),
    LoraModelShape("Qwen2.5-0.5B", 896, 4864, 896, 128),
    LoraModelShape("Qwen2.5-1.5B", 1536, 8960, 1536, 256),
    LoraModelShape("Qwen2.5-7B", 3584, 18944, 3584, 512),
    LoraModelShape("Qwen3-0.6B", 1024, 3072, 2048, 1024),
    LoraModelShape("Phi-3-mini", 3072, 8192, 3072, 3072),
    LoraModelShape("Gemma-2-2B", 2304, 9216, 2048, 1024),
    LoraModelShape("Gemma-3-1B", 1152, 6912, 1024, 256),
)
RANKS = (8, 16, 64)  # the common PEFT ranks; a stack takes the largest loaded rank per product
DTYPES = aot.DTYPES
NUM_SLOTS = 8  # loaded adapters in the stacks: the slot is read on the device, no hint depends on it


@dataclass(frozen=True)
class LoraStepLayout:
    """A step's adapter rows as segments (first row, end, slot): the longest picks the tiles' rows (BLOCK_M)."""

    name: str
    num_tokens: int
    segments: tuple[tuple[int, int, int], ...]


LORA_STEP_LAYOUTS = (
    LoraStepLayout("decode: 8 adapters, a row each, and base rows", 12,
                   tuple((row, row + 1, row) for row in range(8))),
    LoraStepLayout("decode: 3 adapters of 8 rows and 2 of 20", 72,
                   ((0, 8, 0), (8, 16, 1), (16, 24, 2), (24, 44, 3), (44, 64, 4))),
    LoraStepLayout("2 decodes and a 300-row prompt chunk", 302, ((0, 1, 0), (1, 2, 1), (2, 302, 2))),
)


@dataclass(frozen=True)
class LoraCase:
    shape: LoraModelShape
    rank: int
    dtype: str
    layout: LoraStepLayout


def full_matrix() -> list[LoraCase]:
    return [LoraCase(*combo) for combo in itertools.product(LORA_MODEL_SHAPES, RANKS, DTYPES, LORA_STEP_LAYOUTS)]


def covering_sample() -> list[LoraCase]:
    """Every pair of values of the axes the tiles depend on (the dtype picks the K tile and the widest row tile,
    the layout the row tile, the rank the rank tile), in nine cases: a Latin square over dtype x layout with the
    rank; the models' shapes in turn (their sizes are all multiples of 16: the same hints)."""
    cases = []
    for i in range(len(DTYPES) * len(LORA_STEP_LAYOUTS)):
        dtype, layout = DTYPES[i % len(DTYPES)], LORA_STEP_LAYOUTS[i // len(DTYPES)]
        rank = RANKS[(i + i // len(DTYPES)) % len(RANKS)]
        cases.append(LoraCase(LORA_MODEL_SHAPES[i % len(LORA_MODEL_SHAPES)], rank, dtype, layout))
    return cases


def launches_of(case: LoraCase) -> list[aot.Specialization]:
    """The kernel launches of one layer's four LoRA adds in a step of this layout."""
    import torch

    from pagecli.kernels.lora import lora_add, lora_tiles

    dtype = getattr(torch, case.dtype)
    meta = torch.device("meta")
    tiles = lora_tiles([(start, end, slot, 0.5) for start, end, slot in case.layout.segments], dtype, meta)
    with aot._recording_launches(("lora",)) as recorded:
        for _, in_features, out_features, rank in case.shape.products(case.rank):
            x = torch.empty(case.layout.num_tokens, in_features, dtype=dtype, device=meta)
            out = torch.empty(case.layout.num_tokens, out_features, dtype=dtype, device=meta)
            a = torch.empty(NUM_SLOTS, rank, in_features, dtype=dtype, device=meta)  # [slots, rank, in]
            b = torch.empty(NUM_SLOTS, rank, out_features, dtype=dtype, device=meta)  # [slots, rank, out]
            lora_add(out, x, a, b, tiles)
    return recorded


def collect(cases: list[LoraCase]) -> dict[aot.Specialization, list[str]]:
    """The distinct specializations the cases launch (the LoRA tiles do not depend on the target), each with the
    models that launch it."""
    found: dict[aot.Specialization, list[str]] = {}
    for case in cases:
        for spec in launches_of(case):
            names = found.setdefault(spec, [])
            if case.shape.name not in names:
                names.append(case.shape.name)
    return found


def main(argv: list[str] | None = None) -> int:
    args = aot.parse_args("python -m pagecli.attention.aot_lora", __doc__.split("\n\n")[0],
                          "one row per target, kernel and dtype", argv)
    archs = aot.targets(args)
    if archs is None:
        return 2
    specs = collect(covering_sample() if args.sample else full_matrix())
    if args.list:
        aot._print_list(specs, args.json)
        return 0
    return aot.report(aot.compile_all(specs, archs, max(1, args.jobs)), len(specs), len(archs), args)


if __name__ == "__main__":
    sys.exit(main())
