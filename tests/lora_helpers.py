"""Random PEFT LoRA adapters over the tiny test models, and PEFT's own greedy output as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's checkpoint names


@pytest.fixture(autouse=True)
def one_thread():
    """The LoRA tests pin torch to one thread (a shared machine's second core is not theirs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_adapter(base: Path, out: Path, rank: int = 8, targets: list[str] | None = None, seed: int = 0,
                 rslora: bool = False, alpha: int | None = None, b_scale: float = 0.3) -> Path:
    """A PEFT adapter with random A and B (PEFT's default B is zero: no effect) saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if targets is None:
        fused = getattr(model.config, "model_type", "") == "phi3"
        targets = FUSED if fused else ATTENTION + MLP
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, init_lora_weights=False,
                        use_rslora=rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """PEFT's greedy tokens (PeftModel on the fp32 base); adapter None: the base alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0][len(prompt_ids):].tolist()
