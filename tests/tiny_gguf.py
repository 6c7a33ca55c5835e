"""GGUF files of tiny Hugging Face models, written with the gguf package the way llama.cpp's converter lays
them out: metadata under the architecture's prefix, its tensor names, q/k rows reordered for llama only,
the tokenizer and chat template in the file. Projections may be stored as Q8_0 or Q4_0 blocks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pagecli.models import gguf_convert


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's HF -> GGUF converter does to a llama model's q/k rows (pairs the two rotary halves)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(hf_folder: Path, gguf_path: Path, architecture: str, projections: str = "F32") -> None:
    """hf_folder's model as a GGUF of `architecture` (llama, qwen2, qwen3); projections: F32, Q8_0 or Q4_0
    for the decoder layers' matrices (everything else stays F32)."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    config = json.loads((hf_folder / "config.json").read_text())
    weights = load_file(str(hf_folder / "model.safetensors"))
    tokenizer = json.loads((hf_folder / "tokenizer.json").read_text())
    special = {token["content"] for token in tokenizer["added_tokens"]}
    tokens = [token for token, _ in sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), config["vocab_size"])]
    token_types = [gguf.TokenType.CONTROL if token in special else
                   gguf.TokenType.USER_DEFINED if token.startswith("[PAD") else gguf.TokenType.NORMAL
                   for token in tokens]

    writer = gguf.GGUFWriter(str(gguf_path), architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges([" ".join(pair) for pair in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(AutoTokenizer.from_pretrained(hf_folder).chat_template)

    gguf_names = {value: key for key, value in gguf_convert._GLOBAL_TENSOR_NAMES.items()}
    for index in range(config["num_hidden_layers"]):
        for gguf_suffix, hf_suffix in gguf_convert._LAYER_TENSOR_NAMES.items():
            gguf_names[f"model.layers.{index}.{hf_suffix}"] = f"blk.{index}.{gguf_suffix}"
    block_type = getattr(gguf.GGMLQuantizationType, projections)
    for hf_name, weight in weights.items():
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if architecture == "llama" and hf_name.endswith("q_proj.weight"):
            weight = llama_cpp_permute(weight, config["num_attention_heads"])
        elif architecture == "llama" and hf_name.endswith("k_proj.weight"):
            weight = llama_cpp_permute(weight, config["num_key_value_heads"])
        if hf_name.endswith("_proj.weight") and projections != "F32":
            writer.add_tensor(gguf_names[hf_name], gguf.quants.quantize(weight, block_type), raw_dtype=block_type)
        else:
            writer.add_tensor(gguf_names[hf_name], weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
