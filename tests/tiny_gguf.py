"""GGUF files of tiny Hugging Face models, written with the gguf package the way llama.cpp's converter lays
them out: metadata under the architecture's prefix, its tensor names, q/k rows reordered for llama only,
the tokenizer and chat template in the file. Projections may be stored as Q8_0 or Q4_0 blocks. A mixture of
experts (Mixtral as `llama`, `qwen3moe`, `olmoe`) gets its expert metadata and, per layer, the experts stacked
into ffn_{gate,up,down}_exps [experts, out, in] and the router as ffn_gate_inp, as llama.cpp's converter writes
them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from pagecli.models import gguf_convert

# A checkpoint's expert weight -> its layer, expert and GGUF stacked tensor (Mixtral's w1/w3/w2, the others')
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_STACKED = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps", "gate_proj": "ffn_gate_exps",
            "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's HF -> GGUF converter does to a llama model's q/k rows (pairs the two rotary halves)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(hf_folder: Path, gguf_path: Path, architecture: str, projections: str = "F32",
                    drop: tuple[str, ...] = (), metadata: dict | None = None) -> None:
    """hf_folder's model as a GGUF of `architecture` (llama, qwen2, qwen3, qwen3moe, olmoe; a Mixtral folder as
    llama); projections: F32, Q8_0 or Q4_0 for the decoder layers' matrices and experts (everything else stays
    F32). drop: GGUF tensor names left out; metadata: expert fields (without the architecture prefix) set over
    the model's (a malformed file)."""
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
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    if num_experts:
        fields = {"expert_count": num_experts, "expert_used_count": config["num_experts_per_tok"],
                  "expert_feed_forward_length": config.get("moe_intermediate_size"), **(metadata or {})}
        for key, value in fields.items():
            if value is not None:
                writer.add_uint32(f"{architecture}.{key}", value)

    gguf_names = {value: key for key, value in gguf_convert._GLOBAL_TENSOR_NAMES.items()}
    for index in range(config["num_hidden_layers"]):
        for gguf_suffix, hf_suffix in gguf_convert._LAYER_TENSOR_NAMES.items():
            gguf_names[f"model.layers.{index}.{hf_suffix}"] = f"blk.{index}.{gguf_suffix}"
    block_type = getattr(gguf.GGMLQuantizationType, projections)
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, weight in weights.items():
        if (match := _EXPERT.fullmatch(hf_name)) is not None:
            stacked_name = f"blk.{match.group(1)}.{_STACKED[match.group(3)]}.weight"
            stacked.setdefault(stacked_name, {})[int(match.group(2))] = weight
            continue
        if (match := _ROUTER.fullmatch(hf_name)) is not None:
            gguf_names[hf_name] = f"blk.{match.group(1)}.ffn_gate_inp.weight"
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if architecture == "llama" and hf_name.endswith("q_proj.weight"):
            weight = llama_cpp_permute(weight, config["num_attention_heads"])
        elif architecture == "llama" and hf_name.endswith("k_proj.weight"):
            weight = llama_cpp_permute(weight, config["num_key_value_heads"])
        if gguf_names[hf_name] in drop:
            continue
        if hf_name.endswith("_proj.weight") and projections != "F32":
            writer.add_tensor(gguf_names[hf_name], gguf.quants.quantize(weight, block_type), raw_dtype=block_type)
        else:
            writer.add_tensor(gguf_names[hf_name], weight)
    for name, experts in stacked.items():
        weight = np.stack([experts[index] for index in range(num_experts)]).astype(np.float32)  # [experts, out, in]
        if name in drop:
            continue
        if projections != "F32":
            writer.add_tensor(name, gguf.quants.quantize(weight, block_type), raw_dtype=block_type)
        else:
            writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
