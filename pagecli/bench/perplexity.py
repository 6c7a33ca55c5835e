"""Perplexity of a model over a text, in windows as llama.cpp's llama-perplexity computes it, so a
quantization can be weighed against bf16 (and against llama-perplexity on the same GGUF).

The text is tokenized once and cut into non-overlapping windows of `ctx` tokens (the tail that does
not fill a window is dropped). Each window is evaluated from an empty cache; where the tokenizer
starts text with BOS, the window's first token is replaced by BOS (as llama-perplexity does). Only the
second half of each window is scored, so every scored token sees at least ctx / 2 tokens of context:
the logits at positions ctx/2 .. ctx-2 against the tokens that follow them (ctx/2 - 1 per window).
ppl = exp(mean negative log-likelihood over every scored token); its standard error, as llama-perplexity
prints it, is ppl times the standard error of that mean (the spread of the per-token values over the
square root of their count). It says how far another text of this kind could move the figure, not how
far two runs on this text are apart: those share their tokens, so their difference is much steadier
(--kl-base compares them position by position).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagecli.attention import AttentionMetadata
from pagecli.kv_format import KVFormat
from pagecli.errors import PagecliError

MIN_CTX = 8


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    windows: int
    ctx: int
    tokens_scored: int
    running_ppl: tuple[float, ...]  # after each window, as llama-perplexity prints them
    stderr: float = 0.0  # of ppl (module docstring); 0 with a single scored token


def text_windows(token_ids: list[int], ctx: int, bos_id: int | None) -> list[list[int]]:
    """Non-overlapping windows of ctx tokens; the first token of each is BOS when bos_id is given."""
    if ctx < MIN_CTX:
        raise PagecliError(f"--ctx must be at least {MIN_CTX} tokens (got {ctx}).")
    count = len(token_ids) // ctx
    if count == 0:
        raise PagecliError(f"The text has {len(token_ids)} tokens, fewer than one window of --ctx {ctx}; "
                           "use a longer text or a smaller --ctx.")
    windows = [list(token_ids[i * ctx:(i + 1) * ctx]) for i in range(count)]
    if bos_id is not None:
        for window in windows:
            window[0] = bos_id
    return windows


@torch.inference_mode()
def window_logprobs(model: Any, backend: Any, window: list[int], block_size: int, kv_format: KVFormat,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [n, vocab] float32, the tokens that follow [n]) at the scored positions of one
    window's second half, from an empty cache of its own in the engine's KV format (the engine's block
    pool is not touched)."""
    ctx = len(window)
    spec = model.spec
    num_blocks = -(-ctx // block_size)
    # [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, row (kv_format.py)]
    kv_caches = torch.empty(spec.num_layers, 2, *kv_format.cache_shape(num_blocks, block_size, spec.num_kv_heads),
                            dtype=kv_format.storage_dtype, device=device)
    meta = AttentionMetadata.build([ctx], [ctx], [list(range(num_blocks))], list(range(ctx)), 0, device)
    ids = torch.tensor(window, dtype=torch.int64, device=device)  # [ctx]
    positions = torch.arange(ctx, device=device)  # [ctx]
    hidden = model.forward(ids, positions, kv_caches, meta, backend)  # [ctx, hidden]
    first = ctx // 2
    logits = model.compute_logits(hidden[first:ctx - 1]).float()  # [ctx - 1 - first, vocab]
    return torch.log_softmax(logits, dim=-1).cpu(), ids[first + 1:].cpu()


def scored_windows(engine: Any, text: str, ctx: int) -> list[list[int]]:
    """The windows of `text` this engine scores (its tokenizer; BOS first where it starts text with one)."""
    if ctx > engine.max_model_len:
        raise PagecliError(f"--ctx {ctx} is longer than this engine's context ({engine.max_model_len} tokens); "
                           "lower --ctx or raise --max-model-len.")
    tokenizer = engine.tokenizer
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    starts_with_bos = tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id] and tokenizer.bos_token_id is not None
    return text_windows(token_ids, ctx, tokenizer.bos_token_id if starts_with_bos else None)


def perplexity(engine: Any, text: str, ctx: int, on_window: Callable[[int, int, float], None] | None = None,
               on_logprobs: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> Perplexity:
    """The engine's model's perplexity over `text` (windows above); on_window(done, total, running ppl);
    on_logprobs(log-probabilities [n, vocab], next tokens [n]) for each window's scored positions."""
    windows = scored_windows(engine, text, ctx)
    loaded = engine.loaded
    nll_sum, nll_squares, scored, running = 0.0, 0.0, 0, []
    for index, window in enumerate(windows):
        logp, targets = window_logprobs(loaded.model, engine.backend, window, engine.config.block_size,
                                        engine.kv_format, loaded.device)
        if on_logprobs is not None:
            on_logprobs(logp, targets)
        nll = -logp.gather(1, targets[:, None]).squeeze(1)  # [n]
        nll_sum, scored = nll_sum + float(nll.double().sum()), scored + int(nll.numel())
        nll_squares += float(nll.double().square().sum())
        running.append(math.exp(nll_sum / scored))
        if on_window is not None:
            on_window(index + 1, len(windows), running[-1])
    mean = nll_sum / scored
    variance = max(0.0, nll_squares / scored - mean * mean) * scored / max(1, scored - 1)
    return Perplexity(running[-1], len(windows), ctx, scored, tuple(running),
                      running[-1] * math.sqrt(variance / scored) if scored > 1 else 0.0)
