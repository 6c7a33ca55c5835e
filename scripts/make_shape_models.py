"""Random-weight models of real shapes, for speed measurements at the sizes people run.

    .venv/bin/python scripts/make_shape_models.py [--out DIR] [--shapes smollm2-1.7b,qwen2.5-0.5b]
        [--llama-cpp DIR]   # a llama.cpp source tree with build/bin/llama-quantize: also GGUF files

Speed does not depend on the weights' values, so each model is a Hugging Face folder (config.json,
bf16 safetensors, the embedded SmolLM2 tokenizer and chat template) with normal(0, 0.02) weights.
With --llama-cpp, each folder is also converted by llama.cpp's own convert_hf_to_gguf.py to an F16
GGUF and quantized by its llama-quantize to Q8_0 and Q4_0, for llama-bench and llama-server.

Shapes (the published configs; smollm2-135m is the embedded model's own shape; the 0.5B GQA model
keeps SmolLM2's 49,152-token vocabulary, so one tokenizer serves all, which shrinks its embedding from 136M to 44M parameters, and is written as a
Llama-architecture model without Qwen2's q/k/v biases, since llama.cpp's converter does not take
SmolLM2's tokenizer under the Qwen2 architecture: say so beside figures):
  smollm2-135m   30 layers, hidden 576, 9 heads / 3 kv heads, MLP 1536, tied embeddings: 0.13B
  smollm2-1.7b   24 layers, hidden 2048, 32 heads (no GQA), MLP 8192, tied embeddings: 1.71B
  qwen2.5-0.5b   24 layers, hidden 896, 14 heads / 2 kv heads, MLP 4864, tied embeddings: 0.40B
  host-probe     30 layers, hidden 64, 1 head of 64, MLP 128, tied: the engine's host time
  llama2-7b      32 layers, hidden 4096, 32 heads (no GQA), head size 128, MLP 11008, its own output
                 layer: 6.88B (Llama-2-7B's shape with this vocabulary; 13.8 GB of bf16, in shards of
                 about 2 GB, built one at a time so that making it needs about 2 GB of memory)
  olmoe-1b-7b    OLMoE-1B-7B: 16 layers, hidden 2048, 16 heads, 64 experts of width 1024, 8 per token,
                 q/k norms over the whole projection, its own output layer: 6.91B, 1.17B active per token
                 (this vocabulary instead of its 50,304; 13.7 GB of bf16 in shards)

llama.cpp's converter also needs the `sentencepiece` package in the python that runs it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    "smollm2-135m": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
                         mlp_bias=False),
    "smollm2-1.7b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, head_dim=64, rms_norm_eps=1e-5, rope_theta=130000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
                         mlp_bias=False),
    "qwen2.5-0.5b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=False,
                         mlp_bias=False),
    # Real depth and vocabulary, negligible width: the engine's host time per step (scripts/bench_host.py).
    "host-probe": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                       intermediate_size=128, num_hidden_layers=30, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                       max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
                       mlp_bias=False),
    "llama2-7b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
                      intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
                      mlp_bias=False),
    "olmoe-1b-7b": dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], hidden_size=2048,
                        intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
                        num_key_value_heads=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                        max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
                        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, clip_qkv=None),
}
SHARD_BYTES = 2 * 1024**3  # past this a model is written in shards, each built and freed in turn
VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every weight of the model, named as transformers names them; [out_features, in_features]."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (VOCAB, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        })
        if config.get("num_experts"):  # OLMoE: a router, each expert's gated MLP, q/k norms over the projection
            shapes[p + "self_attn.q_norm.weight"] = (heads * head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (kv_heads * head_dim,)
            shapes[p + "mlp.gate.weight"] = (config["num_experts"], hidden)
            for e in range(config["num_experts"]):
                shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (inter, hidden),
                               p + f"mlp.experts.{e}.up_proj.weight": (inter, hidden),
                               p + f"mlp.experts.{e}.down_proj.weight": (hidden, inter)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                           p + "mlp.down_proj.weight": (hidden, inter)})
    return shapes


def shard_names(shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """The file each tensor goes in: model.safetensors, or model-0000i-of-0000n.safetensors in order,
    a new shard when the current one would pass SHARD_BYTES."""
    shard_of: dict[str, int] = {}
    shard, size = 0, 0
    for key, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if size and size + nbytes > SHARD_BYTES:
            shard, size = shard + 1, 0
        shard_of[key] = shard
        size += nbytes
    count = shard + 1
    return {key: "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            for key, i in shard_of.items()}


def make_model(name: str, out: Path, tokenizer_dir: Path) -> Path:
    folder = out / name
    if (folder / "config.json").is_file():
        print(f"{name}: {folder} exists")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = {**SHAPES[name], "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "torch_dtype": "bfloat16", "use_cache": True}
    generator = torch.Generator().manual_seed(0)
    shapes = tensor_shapes(config)
    shards = shard_names(shapes)
    params = 0
    weight_map: dict[str, str] = {}
    for file in dict.fromkeys(shards.values()):  # each shard built, written and freed in turn
        tensors = {}
        for key in (k for k, f in shards.items() if f == file):
            shape = shapes[key]
            if len(shape) == 1 and key.endswith("norm.weight"):
                tensors[key] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[key] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            params += tensors[key].numel()
            weight_map[key] = file
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
    if len(set(shards.values())) > 1:
        index = {"metadata": {"total_size": params * 2}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, folder / file)
    print(f"{name}: {params / 1e9:.2f}B parameters, bf16, in {folder}")
    return folder


def make_ggufs(folder: Path, llama_cpp: Path) -> None:
    f16 = folder.parent / f"{folder.name}.F16.gguf"
    if not f16.is_file():
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f16",
                        "--outfile", str(f16)], check=True)
    for kind in ("Q8_0", "Q4_0"):
        target = folder.parent / f"{folder.name}.{kind}.gguf"
        if not target.is_file():
            subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(f16), str(target), kind],
                           check=True)
        print(f"{folder.name}: {target}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path.home() / ".cache" / "pagecli-bench" / "models"))
    ap.add_argument("--shapes", default="smollm2-1.7b,qwen2.5-0.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--llama-cpp", default=None, help="llama.cpp source tree (with build/bin/llama-quantize)")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="folder with SmolLM2's tokenizer.json and chat template (default: the embedded model's)")
    args = ap.parse_args()
    if args.tokenizer_dir:
        tokenizer_dir = Path(args.tokenizer_dir)
    else:
        from pagecli.models.source import prepare_default_model

        tokenizer_dir = prepare_default_model()
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"unknown shape '{name}'; choose from {', '.join(SHAPES)}")
        folder = make_model(name, Path(args.out), tokenizer_dir)
        if args.llama_cpp:
            make_ggufs(folder, Path(args.llama_cpp))


if __name__ == "__main__":
    main()
