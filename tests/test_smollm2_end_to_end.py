"""The embedded SmolLM2-135M-Instruct through `pagecli generate` equals transformers, token for token."""

from __future__ import annotations

import json

import pytest
import torch

from pagecli.cli import main

MAX_TOKENS = 24
LONG_CONTEXT = (
    "PagedAttention stores the key and value cache of a language model in fixed-size blocks, the way an "
    "operating system pages memory. A block table maps each sequence's logical blocks to physical ones, "
    "so memory is allocated on demand, fragmentation is bounded by one block per sequence, and blocks "
    "holding a shared prefix, such as a system prompt, can be referenced by many sequences at once. "
) * 3
REQUESTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]},
    {"messages": [{"role": "user", "content": "Traduis en français : « good morning, my friend »"}]},
    {"messages": [{"role": "user", "content": "日本の首都はどこですか？"}]},
    {"messages": [{"role": "user", "content": "Summarise this:\n" + LONG_CONTEXT}]},
    {"prompt": "The quick brown fox"},
    {"prompt": "def fibonacci(n):\n    "},
    {"prompt": "Emoji test 🚀🔥 and accents: naïve café"},
    {"messages": [{"role": "user", "content": "Count from 1 to 10."}]},
]


@pytest.mark.slow
def test_generate_matches_transformers_greedy_on_varied_prompts(smollm2_dir, smollm2_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in REQUESTS), encoding="utf-8")
    assert main(["generate", str(src), "-o", str(dst), "-m", str(smollm2_dir), "--dtype", "float32",
                 "-t", "0", "-n", str(MAX_TOKENS), "--no-progress"]) == 0
    results = [json.loads(line) for line in dst.read_text(encoding="utf-8").splitlines()]

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    long_prompts = 0
    for request, result in zip(REQUESTS, results, strict=True):
        if "messages" in request:
            text = tokenizer.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(request["prompt"])["input_ids"]
        long_prompts += len(ids) > 200
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)[0][len(ids):].tolist()
        assert result["prompt_tokens"] == len(ids)
        assert result["completion_tokens"] == len(out), (request, result)
        assert result["text"] == tokenizer.decode(out, skip_special_tokens=True), (request, result)
    assert long_prompts >= 1, "one prompt must be over 200 tokens"
