"""A random-weight GGUF file of a real shape, laid out as llama.cpp's `llama-quantize` writes a Q4_0 file, for
measuring what pagecli does with a large file (its cache, its start) without llama.cpp or a model download.

    .venv/bin/python scripts/make_random_gguf.py OUT.gguf [--shape llama2-7b|smollm2-1.7b] [--type Q4_0|Q8_0]

Decoder matrices and the embedding table in --type, the output layer in Q6_K (llama-quantize's choice for
its Q4_0 and Q8_0 files), norms in F32 (ones). The blocks' bytes are random with a small fixed scale, so
the weights are finite and the logits not flat; speed and sizes do not depend on the values. The vocabulary,
tokenizer and chat template are the embedded SmolLM2's (49,152 tokens), as scripts/make_shape_models.py uses.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SHAPES = {  # layers, hidden, heads, kv heads, MLP width
    "llama2-7b": (32, 4096, 32, 32, 11008),
    "smollm2-1.7b": (24, 2048, 32, 32, 8192),
    "tiny": (2, 256, 4, 2, 512),  # for tests
}
_TOKENIZER_FIELDS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                     "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                     "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template")


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """uint8 [rows, bytes of a row] of `kind` blocks: random quants, a scale of 2^-9 (Q6_K: its scales 1..8)."""
    import gguf

    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, kind)]
    blocks = rng.integers(0, 256, (rows * cols // block_weights, block_bytes), dtype=np.uint8)
    scale = np.array([2.0 ** -9], dtype=np.float16).view(np.uint8)
    if kind == "Q6_K":  # ql[128], qh[64], scales int8[16], d fp16
        blocks[:, 192:208] = rng.integers(1, 9, (blocks.shape[0], 16), dtype=np.uint8)
        blocks[:, 208:210] = scale
    else:  # Q4_0, Q8_0: d fp16 first
        blocks[:, 0:2] = scale
    return blocks.reshape(rows, -1)


def write_random_gguf(out: Path, shape: str = "llama2-7b", block_type: str = "Q4_0",
                      types: dict[str, str] | None = None) -> None:
    """The file (module docstring) of this shape, its decoder matrices and embedding table in block_type;
    types: another type for some tensors by their GGUF name (a Q4_K_M-like mix: "blk.0.ffn_down.weight": "Q6_K")."""
    types = types or {}
    import gguf

    from pagecli.models.source import default_model_gguf

    layers, hidden, heads, kv_heads, mlp = SHAPES[shape]
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    source = gguf.GGUFReader(default_model_gguf())
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(mlp)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for key in _TOKENIZER_FIELDS:
        field = source.fields[key]
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type)

    kind = getattr(gguf.GGMLQuantizationType, block_type)
    q6_k = gguf.GGMLQuantizationType.Q6_K
    writer.add_tensor("token_embd.weight", random_blocks(rng, vocab, hidden, block_type), raw_dtype=kind)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output.weight", random_blocks(rng, vocab, hidden, "Q6_K"), raw_dtype=q6_k)
    matrices = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
                "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
                "ffn_gate": (mlp, hidden), "ffn_up": (mlp, hidden), "ffn_down": (hidden, mlp)}
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, (rows, cols) in matrices.items():
            tensor = f"blk.{layer}.{name}.weight"
            own = types.get(tensor, block_type)
            writer.add_tensor(tensor, random_blocks(rng, rows, cols, own), raw_dtype=getattr(gguf.GGMLQuantizationType, own))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    ap.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q8_0"))
    args = ap.parse_args()
    write_random_gguf(Path(args.out), args.shape, args.type)
    print(f"{args.out}: {Path(args.out).stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
