"""Roofline estimates of pagecli's Triton kernels and of a whole decode step on A100 and H100, for docs/GPU.md.

Bytes are the least each call must move through DRAM (K/V read once, queries and outputs once); FLOPs are
the useful ones (no padding). A call's floor is max(bytes / bandwidth, FLOPs / peak). Prints Markdown.
Usage: python scripts/gpu_roofline.py
"""

from __future__ import annotations

from dataclasses import dataclass

BF16_BYTES = 2


@dataclass(frozen=True)
class Gpu:
    name: str
    bandwidth_bytes_s: float
    peak_bf16_flops: float


GPUS = (Gpu("A100 80GB", 2.0e12, 312e12), Gpu("H100 SXM", 3.35e12, 989e12))


@dataclass(frozen=True)
class Model:
    name: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @property
    def params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.num_layers * (attention + mlp) + embeddings

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies by: all but the embedding lookup (the LM head is one)."""
        return self.params - (0 if self.tied else self.vocab * self.hidden)


SMOLLM2 = Model("SmolLM2-135M", 30, 576, 1536, 9, 3, 64, 49152, True)
LLAMA2_7B = Model("Llama-2-7B", 32, 4096, 11008, 32, 32, 128, 32000, False)
LLAMA3_8B = Model("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, 128256, False)


def decode_call(m: Model, batch: int, context: int) -> tuple[float, float]:
    """One layer's paged decode attention: bytes, FLOPs."""
    kv = batch * context * m.num_kv_heads * m.head_dim * 2 * BF16_BYTES
    q_and_out = 2 * batch * m.num_heads * m.head_dim * BF16_BYTES
    table = batch * context // 16 * 4
    return kv + q_and_out + table, 4 * batch * m.num_heads * context * m.head_dim


def prefill_call(m: Model, new_tokens: int, prefix: int) -> tuple[float, float]:
    """One layer's prefill over a paged prefix, causal among the new tokens: bytes, FLOPs."""
    kv = (prefix + new_tokens) * m.num_kv_heads * m.head_dim * 2 * BF16_BYTES
    q_and_out = 2 * new_tokens * m.num_heads * m.head_dim * BF16_BYTES
    pairs = new_tokens * prefix + new_tokens * (new_tokens + 1) / 2
    return kv + q_and_out, 4 * m.num_heads * m.head_dim * pairs


def store_call(m: Model, tokens: int) -> tuple[float, float]:
    """One layer's KV store: read K and V, write them into their slots."""
    return 2 * 2 * tokens * m.num_kv_heads * m.head_dim * BF16_BYTES, 0.0


def floor_us(gpu: Gpu, nbytes: float, flops: float) -> tuple[float, str]:
    memory_s, compute_s = nbytes / gpu.bandwidth_bytes_s, flops / gpu.peak_bf16_flops
    return max(memory_s, compute_s) * 1e6, "memory" if memory_s >= compute_s else "compute"


def kernel_table() -> str:
    rows = [
        ("decode", SMOLLM2, "batch 1, context 1024", decode_call(SMOLLM2, 1, 1024)),
        ("decode", SMOLLM2, "batch 64, context 1024", decode_call(SMOLLM2, 64, 1024)),
        ("decode", LLAMA2_7B, "batch 1, context 4096", decode_call(LLAMA2_7B, 1, 4096)),
        ("decode", LLAMA2_7B, "batch 32, context 2048", decode_call(LLAMA2_7B, 32, 2048)),
        ("decode", LLAMA3_8B, "batch 32, context 2048", decode_call(LLAMA3_8B, 32, 2048)),
        ("prefill", SMOLLM2, "2048 new tokens, no prefix", prefill_call(SMOLLM2, 2048, 0)),
        ("prefill", LLAMA2_7B, "2048 new tokens, no prefix", prefill_call(LLAMA2_7B, 2048, 0)),
        ("prefill", LLAMA2_7B, "256 new tokens on a 3840-token cached prefix", prefill_call(LLAMA2_7B, 256, 3840)),
        ("store_kv", LLAMA2_7B, "2048 tokens (a prefill chunk)", store_call(LLAMA2_7B, 2048)),
        ("store_kv", LLAMA2_7B, "32 tokens (a decode step)", store_call(LLAMA2_7B, 32)),
    ]
    lines = ["| kernel | model | shape (one layer) | MB moved | GFLOP | FLOP/B | A100 floor µs | H100 floor µs "
             "| bound |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for kernel, model, shape, (nbytes, flops) in rows:
        a100, bound = floor_us(GPUS[0], nbytes, flops)
        h100, _ = floor_us(GPUS[1], nbytes, flops)
        lines.append(f"| {kernel} | {model.name} | {shape} | {nbytes / 1e6:,.2f} | {flops / 1e9:,.2f} | "
                     f"{flops / nbytes:,.1f} | {a100:,.1f} | {h100:,.1f} | {bound} |")
    return "\n".join(lines)


def step_table() -> str:
    """A whole decode step: every weight read once, every sequence's KV read once, matmul FLOPs."""
    lines = ["| model | batch x context | weights GB | KV GB | GFLOP | A100 floor ms | tok/s | H100 floor ms | tok/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model, batch, context in ((SMOLLM2, 1, 1024), (SMOLLM2, 64, 1024), (LLAMA2_7B, 1, 1024),
                                  (LLAMA2_7B, 32, 2048), (LLAMA3_8B, 32, 2048)):
        weights = model.params * BF16_BYTES
        kv = batch * context * model.num_layers * 2 * model.num_kv_heads * model.head_dim * BF16_BYTES
        attention_flops = model.num_layers * decode_call(model, batch, context)[1]
        flops = 2 * model.matmul_params * batch + attention_flops
        cells = []
        for gpu in GPUS:
            step_us, _ = floor_us(gpu, weights + kv, flops)
            cells += [f"{step_us / 1e3:,.2f}", f"{batch / (step_us / 1e6):,.0f}"]
        lines.append(f"| {model.name} ({model.params / 1e9:.2f} B params) | {batch} x {context} | "
                     f"{weights / 1e9:.2f} | {kv / 1e9:.2f} | {flops / 1e9:,.1f} | {' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(kernel_table())
    print()
    print(step_table())
