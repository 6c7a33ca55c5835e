"""Tiny random models of every supported architecture, saved as Hugging Face folders.

Each folder has config.json, model.safetensors, and a small byte-level BPE tokenizer with a
ChatML chat template, so the whole load path (config, weights, tokenizer, template) runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Hello world! How are you today? Très bien, merci. 日本語のテキスト。",
    "def main():\n    print('hello')\n",
] * 20
VOCAB_SIZE = 384


def build_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 8, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    fast.save_pretrained(folder)


def tiny_config(arch: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**{**common, **overrides})
    if arch == "llama3":  # Llama 3 rope scaling, tied embeddings (like Llama 3.2)
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(**{**common, "tie_word_embeddings": True, "rope_parameters": rope, **overrides})
    if arch == "mistral":
        return MistralConfig(**{**common, "sliding_window": None, **overrides})
    if arch == "qwen2":
        return Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    if arch == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 32, **overrides})
    if arch == "gemma2":  # soft-caps small enough that tanh bends the scores; a window shorter than the prompts
        from transformers import Gemma2Config

        return Gemma2Config(**{**common, "head_dim": 16, "tie_word_embeddings": True, "sliding_window": 6,
                               "query_pre_attn_scalar": 24, "attn_logit_softcapping": 3.0,
                               "final_logit_softcapping": 4.0, "pad_token_id": 0, **overrides})
    if arch == "gemma3":  # sliding, sliding, full; the full layers' rope linearly scaled, as Gemma 3 4B's
        from transformers import Gemma3TextConfig

        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
        return Gemma3TextConfig(**{**common, "num_hidden_layers": 3, "head_dim": 16, "tie_word_embeddings": True,
                                   "sliding_window": 6, "query_pre_attn_scalar": 16, "rope_parameters": rope,
                                   "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                                   "pad_token_id": 0, **overrides})
    if arch == "phi3":  # longrope (Phi-3.5, Phi-4-mini's scaling), pretraining length 64 of 512
        from transformers import Phi3Config

        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 10.0, 12.0]}
        return Phi3Config(**{**common, "original_max_position_embeddings": 64, "rope_parameters": rope,
                             "pad_token_id": 0, **overrides})
    if arch == "phi4":  # partial rotary (Phi-4-mini rotates 3/4 of each head), plain rope
        from transformers import Phi3Config

        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
        return Phi3Config(**{**common, "rope_parameters": rope, "pad_token_id": 0, **overrides})
    # Mixtures of experts: 8 experts, 2 per token, so a prompt's tokens spread over several groups.
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(**{**common, "intermediate_size": 48, "num_local_experts": 8, "num_experts_per_tok": 2,
                                "sliding_window": None, **overrides})
    if arch == "qwen3_moe":  # Qwen3-MoE with its dense MLP on the second of three layers (mlp_only_layers)
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**{**common, "num_hidden_layers": 3, "head_dim": 32, "num_experts": 8,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True,
                                 "mlp_only_layers": [1], **overrides})
    if arch == "olmoe":  # OLMoE: q/k norms over the whole projection, the top k probabilities not renormalised
        from transformers import OlmoeConfig

        return OlmoeConfig(**{**common, "intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
                              "norm_topk_prob": False, "pad_token_id": 0, **overrides})
    raise ValueError(arch)


ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
MOE_ARCHS = ("mixtral", "qwen3_moe", "olmoe")
# issue 46's (phi4: a phi3 model with partial rotary)
NEW_ARCHS = ("gemma2", "gemma3", "phi3", "phi4", *MOE_ARCHS)


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name:
                param.normal_(0.0, 0.1)  # non-zero biases, so qkv bias really is tested
            elif arch in NEW_ARCHS and "norm" in name:
                # Gemma's norms multiply by (1 + weight), the others' by weight: around 1 either way, not
                # exactly (ones or zeros would leave the norms' weights untested).
                param.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.2)
            elif arch in NEW_ARCHS:
                param.normal_(0.0, 0.15)  # logits spread widely enough that greedy picks are not near-ties
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    return folder


SYSTEM_FIRST_GUARD = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                      "{{ raise_exception('System message must come first') }}{% endif %}{% endfor %}")


def with_template_prefix(folder: Path, dest: Path, prefix: str = SYSTEM_FIRST_GUARD) -> Path:
    """A copy of the model folder whose chat template starts with `prefix` (by default a guard that
    rejects a system message after the first, as Mistral's and Gemma's templates do)."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        (dest / path.name).write_bytes(path.read_bytes())
    template = dest / "chat_template.jinja"
    template.write_text(prefix + template.read_text())
    return dest
