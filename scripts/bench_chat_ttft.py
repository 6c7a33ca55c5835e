"""Time to first token per turn of an 8-turn chat: pagecli with prefix caching on and off,
and transformers re-prefilling the whole conversation each turn.

    .venv/bin/python scripts/bench_chat_ttft.py [--turns 8] [--reply-tokens 48] [--dtype float32]

Fixed user messages; replies are greedy, capped at --reply-tokens, and the same replies are fed
to every contender so all three see identical conversations. The disk store is off, so the
cached run measures the memory tier only.
"""

from __future__ import annotations

import argparse
import time

import torch

MESSAGES = [
    "Hi! I'm planning a trip to Lisbon next spring. What should I know before I go?",
    "Which neighbourhoods are best to stay in for a first visit, and why?",
    "What are three dishes I must try, and where would I find them?",
    "How do I get from the airport to the city centre cheaply?",
    "Is it worth doing a day trip to Sintra? How would you plan it?",
    "What about the trams: which lines are the most scenic?",
    "Can you suggest a rainy-day plan with museums?",
    "Finally, give me a one-paragraph summary of everything we discussed.",
]


def pagecli_ttfts(folder: str, turns: int, reply_tokens: int, dtype: str, caching: bool,
                  replies: list[list[int]] | None) -> tuple[list[float], list[list[int]], list[int]]:
    from pagecli.config import EngineConfig, SamplingParams
    from pagecli.engine import Engine

    engine = Engine(folder, EngineConfig(dtype=dtype, enable_prefix_caching=caching, disk_cache=False))
    sampling = SamplingParams(temperature=0, max_tokens=reply_tokens)
    engine.generate(["warm up"], SamplingParams(temperature=0, max_tokens=2))
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful travel assistant."}]
    ttfts, produced, prompt_lens = [], [], []
    for turn in range(turns):
        history.append({"role": "user", "content": MESSAGES[turn % len(MESSAGES)]})
        ids = engine.encode(history)
        out = engine.generate([ids], sampling)[0]
        ttfts.append(out.ttft_s or 0.0)
        reply_ids = replies[turn] if replies else list(out.token_ids)
        produced.append(list(out.token_ids))
        prompt_lens.append(len(ids))
        history.append({"role": "assistant", "content": engine.tokenizer.decode(reply_ids, skip_special_tokens=True)})
    return ttfts, produced, prompt_lens


def hf_ttfts(folder: str, turns: int, replies: list[list[int]], dtype: str) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful travel assistant."}]
    ttfts = []
    for turn in range(turns):
        history.append({"role": "user", "content": MESSAGES[turn % len(MESSAGES)]})
        text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=tok.eos_token_id)
        ttfts.append(time.perf_counter() - start)
        history.append({"role": "assistant", "content": tok.decode(replies[turn], skip_special_tokens=True)})
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from pagecli.models.source import prepare_default_model

    folder = str(prepare_default_model())
    cached, replies, prompt_lens = pagecli_ttfts(folder, args.turns, args.reply_tokens, args.dtype, True, None)
    uncached, _, _ = pagecli_ttfts(folder, args.turns, args.reply_tokens, args.dtype, False, replies)
    hf = hf_ttfts(folder, args.turns, replies, args.dtype)
    print(f"{'turn':>4} {'prompt tokens':>13} {'pagecli cached':>15} {'pagecli no cache':>17} {'transformers':>13}")
    for turn in range(args.turns):
        print(f"{turn + 1:>4} {prompt_lens[turn]:>13} {cached[turn] * 1000:>12.0f} ms {uncached[turn] * 1000:>14.0f} ms"
              f" {hf[turn] * 1000:>10.0f} ms")


if __name__ == "__main__":
    main()
