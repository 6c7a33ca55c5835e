"""The sampler's tensor path: the tokens the CPU kernel (native/sampling.cpp) keeps and the draws it makes,
with tensor operations on the logits' device (a GPU, or a CPU without pagecli's kernels).

A seeded row draws the token here that it draws in the kernel: the same weights (2^t by the kernel's
polynomial, each step rounded as its fused multiply-add rounds), the same uniform numbers from the row's
random word, the same rounds of top-p's rejection against pivots, and the same search of the cumulative
weight in blocks of 64. Sums are taken in another order, so a draw can differ where a boundary falls
within rounding of the target (about one draw in ten million). engine/sampler.py states the filters.
Nothing here waits for the device but the final copy of the tokens to the host.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence as SequenceOf

import torch

from pagecli.config.settings import SamplingParams


def _float32(value: float) -> float:
    """value rounded to float32, as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


LOWEST_LOG2 = -125.0  # weights below 2^-125 (86.6 nats under the top) are 0, as in the kernel
LOG2E = _float32(1.44269504088896341)
# 2^f = sum of ln(2)^k / k! f^k, k = 6 .. 0, as float32 (the kernel's constants).
_POLYNOMIAL = tuple(_float32(c) for c in (1.5403530393381608e-4, 1.3333558146428443e-3, 9.6181291076284772e-3,
                                          5.5504108664821580e-2, 2.4022650695910071e-1, 6.9314718055994531e-1, 1.0))
MAX_ROUNDS = 4  # top-p's rejection rounds before its threshold is found outright (the kernel's kMaxRounds)
BLOCK = 64  # tokens per block of a draw's first search (the kernel's kBlock)

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _signed(value: int) -> int:
    """A 64-bit word as the int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical right shift of int64 words (torch's >> keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def round_uniforms(words: list[int], rounds: int, device: torch.device) -> torch.Tensor:
    """Uniform number r of each row in [0, 1), r < rounds: the top 53 bits of the row's word for r = 0, of
    splitmix64(word + r * golden ratio) after (the kernel's `uniform`). [rows, rounds] float64. int64
    products wrap modulo 2^64, as the words' arithmetic needs."""
    z0 = torch.tensor([_signed(w) for w in words], dtype=torch.int64, device=device)  # [rows]
    columns = [_shift_right(z0, 11)]
    for r in range(1, rounds):
        z = z0 + _signed(r * _GOLDEN)
        z = (z ^ _shift_right(z, 30)) * _signed(0xBF58476D1CE4E5B9)
        z = (z ^ _shift_right(z, 27)) * _signed(0x94D049BB133111EB)
        columns.append(_shift_right(z ^ _shift_right(z, 31), 11))
    return torch.stack(columns, dim=1).double() * 2.0**-53


def weights_of(x: torch.Tensor, top: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """2^((x - top) * scale), 0 below 2^LOWEST_LOG2: x [rows, vocab] float32 without NaN, top and scale
    [rows, 1] float32. The kernel's polynomial: a float32 product of two float32 numbers is exact in
    float64, so each float64 multiply-add rounded to float32 is the kernel's fused one (but where the
    float64 sum itself rounds onto a float32 midpoint)."""
    t = (x - top) * scale  # [rows, vocab] float32, <= 0
    n = torch.round(t)
    f = (t - n).double()
    p = torch.full_like(t, _POLYNOMIAL[0])
    for c in _POLYNOMIAL[1:]:
        p = (p.double() * f + c).float()
    power = n.clamp(min=LOWEST_LOG2 - 1).to(torch.int32) << 23  # n is -inf for a -inf logit
    w = (p.view(torch.int32) + power).view(torch.float32)
    return torch.where(t >= LOWEST_LOG2, w, 0.0)


def top_p_threshold(weights: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """Per row, the largest value v such that the weights >= v hold at least `need` (0 where even all of
    them fall short): a bisection over the weights' float32 bits (ordered as integers, the weights being
    >= 0), 31 rounds of a masked sum. weights [rows, vocab], need [rows, 1] float64; returns [rows, 1]."""
    bits = weights.contiguous().view(torch.int32)  # [rows, vocab]
    lo = torch.zeros_like(need, dtype=torch.int64)  # weights >= 0 hold everything
    hi = torch.full_like(lo, 0x7F800001)  # above +inf: holds nothing
    for _ in range(31):
        mid = (lo + hi) // 2
        held = torch.where(bits >= mid, weights, 0.0).double().sum(dim=-1, keepdim=True)
        enough = held >= need
        lo = torch.where(enough, mid, lo)
        hi = torch.where(enough, hi, mid)
    return lo.to(torch.int32).view(torch.float32)


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose running weight passes u times the row's total: weights [rows, vocab] >= 0, u
    [rows] float64 in [0, 1); [rows] int64, -1 for a row that weighs nothing. As the kernel's `draw_from`:
    float32 sums of blocks of 64 tokens, their running sum in float64, then the tokens of the block it
    lands in; a token of weight 0 is never drawn (where rounding passes every token of that block, the
    block's last kept token, or the row's)."""
    rows, vocab = weights.shape
    padded = torch.nn.functional.pad(weights, (0, -vocab % BLOCK)) if vocab % BLOCK else weights
    blocks = padded.reshape(rows, -1, BLOCK)  # [rows, blocks, 64]
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [rows, blocks]
    total = block_cdf[:, -1:]  # [rows, 1]
    target = u.unsqueeze(1) * total  # [rows, 1]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)  # [rows, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, block.unsqueeze(2).expand(rows, 1, BLOCK)).squeeze(1).double().cumsum(dim=-1)
    offset = torch.searchsorted(inside + before, target, right=True)  # [rows, 1]
    picked = block * BLOCK + offset
    index = torch.arange(vocab, device=weights.device)
    block_end = torch.clamp((block + 1) * BLOCK, max=vocab)
    positive = weights > 0
    last_in_block = torch.where(positive & (index < block_end), index, -1).amax(dim=-1, keepdim=True)
    last_anywhere = torch.where(positive, index, -1).amax(dim=-1, keepdim=True)
    fallback = torch.where(last_in_block >= 0, last_in_block, last_anywhere)
    stray = (offset >= BLOCK) | (picked >= vocab)
    stray = stray | (weights.gather(1, picked.clamp(max=vocab - 1)) == 0)
    chosen = torch.where(stray, fallback, picked)
    return torch.where(total > 0, chosen, -1).squeeze(1)


class RowWeights:
    """A batch's weights after temperature, and what top-k, top-p and min-p make of them: `kept` holds the
    weights of the tokens every filter keeps (0 elsewhere) for the rows decided outright, and
    `rejection` marks the rows of top-p alone, which the kernel decides by rejection against pivots."""

    def __init__(self, logits: torch.Tensor, params: SequenceOf[SamplingParams]) -> None:
        rows, vocab = logits.shape
        device = logits.device
        x = logits.float()
        x = torch.where(torch.isnan(x), float("-inf"), x)  # [rows, vocab]
        top = x.max(dim=-1, keepdim=True).values  # [rows, 1]
        scale = torch.tensor([_float32(LOG2E / p.temperature) for p in params], dtype=torch.float32,
                             device=device).unsqueeze(1)
        e = weights_of(x, torch.where(torch.isinf(top), 0.0, top), scale)
        # A row whose top logit is +inf: its +inf tokens share everything (the limit of their softmax), with
        # no filter after; one whose top is -inf weighs nothing.
        infinite = top == float("inf")
        e = torch.where(infinite, (x == float("inf")).float(), e)
        self.weights = e  # [rows, vocab] float32
        self.total = e.double().sum(dim=-1, keepdim=True)  # [rows, 1]
        tau = torch.tensor([_float32(p.min_p) for p in params], dtype=torch.float32, device=device).unsqueeze(1)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device).unsqueeze(1)
        self.top_p = top_p
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        has_k = torch.tensor(top_k, device=device).unsqueeze(1) > 0  # [rows, 1]
        candidate = torch.ones_like(e, dtype=torch.bool)
        if any(top_k):
            # Top-k: the tokens at or above the k-th largest logit; the k-th largest of their weights is a
            # floor, and top-p is taken among the tokens at or above it.
            k_index = torch.tensor([max(k, 1) - 1 for k in top_k], device=device).unsqueeze(1)
            kth_logit = torch.topk(x, max(top_k), dim=-1).values.gather(1, k_index)
            candidate = torch.where(has_k, x >= kth_logit, candidate)
            kth = torch.topk(torch.where(candidate, e, -1.0), max(top_k), dim=-1).values.gather(1, k_index)
            kth = torch.where(has_k, kth, 0.0)
            tau = torch.maximum(tau, kth)
            picked = torch.where(candidate & (e >= kth), e, 0.0)
            held = picked.double().sum(dim=-1, keepdim=True)
            if any(k and p.top_p < 1.0 for k, p in zip(top_k, params)):  # decided on the host: no wait
                tau = torch.where(has_k & (top_p < 1.0), torch.maximum(tau, top_p_threshold(picked, top_p * held)), tau)
        # Rows of top-p alone; `any_rejection` says on the host whether there may be one (+inf rows are not).
        self.any_rejection = any(not k and p.top_p < 1.0 for k, p in zip(top_k, params))
        self.rejection = (~has_k) & (top_p < 1.0) & ~infinite  # [rows, 1]
        tau = torch.where(infinite, 1.0, tau)
        self.floor = tau  # [rows, 1] float32: min-p's floor for rejection rows, the final threshold else
        self.kept = torch.where(candidate & (e >= tau), e, 0.0)  # [rows, vocab]

    def top_p_kept(self) -> torch.Tensor:
        """The weights every filter keeps, top-p's threshold found outright for the rejection rows."""
        need = self.top_p * self.total
        threshold = torch.maximum(self.floor, top_p_threshold(self.weights, need))
        tau = torch.where(self.rejection, threshold, self.floor)
        return torch.where((self.kept > 0) & (self.weights >= tau), self.weights, 0.0)


def kept_weights(logits: torch.Tensor, params: SequenceOf[SamplingParams]) -> torch.Tensor:
    """Each row's weights after filters 3-6, zero where a filter dropped the token: [rows, vocab] float32."""
    return RowWeights(logits, params).top_p_kept()


def sample_rows_torch(logits: torch.Tensor, params: SequenceOf[SamplingParams], words: list[int]) -> list[int]:
    """Filters 3-6 and a draw for rows [rows, vocab], each with its random word, as the CPU kernel draws
    them; -1 for a row with no drawable token."""
    return sample_rows_tensor(logits, params, words).tolist()


def sample_rows_tensor(logits: torch.Tensor, params: SequenceOf[SamplingParams], words: list[int]) -> torch.Tensor:
    """sample_rows_torch's tokens as a [rows] int64 tensor on the logits' device (no wait for it)."""
    filtered = RowWeights(logits, params)
    u = round_uniforms(words, MAX_ROUNDS + 1, logits.device)  # [rows, rounds]
    tokens = draw(filtered.kept, u[:, 0])  # the rows decided outright; the rejection rows' first try
    if filtered.any_rejection:
        tokens = torch.where(filtered.rejection.squeeze(1), _rejection_draws(filtered, u), tokens)
    return tokens


def _rejection_draws(filtered: RowWeights, u: torch.Tensor) -> torch.Tensor:
    """Top-p alone by rejection against pivots (the kernel's `draw_top_p`): draw from the tokens at or above
    the pivot (min-p's floor at first); a token whose heavier tokens hold less than top_p of the total is
    the answer, else the pivot moves just above its weight. After MAX_ROUNDS, top-p's threshold outright."""
    e = filtered.weights
    need = filtered.top_p * filtered.total  # [rows, 1]
    tau = filtered.floor.squeeze(1)  # [rows]
    result = torch.full_like(tau, -1, dtype=torch.int64)
    open_rows = torch.ones_like(tau, dtype=torch.bool)
    for r in range(MAX_ROUNDS):
        token = draw(torch.where(e >= tau.unsqueeze(1), e, 0.0), u[:, r])
        weight = e.gather(1, token.clamp(min=0).unsqueeze(1))  # [rows, 1]
        above = torch.where(e > weight, e, 0.0).double().sum(dim=-1, keepdim=True)
        done = open_rows & ((token < 0) | (above < need).squeeze(1))
        result = torch.where(done, token, result)
        open_rows = open_rows & ~done
        tau = torch.where(open_rows, torch.nextafter(weight.squeeze(1), torch.full_like(tau, float("inf"))), tau)
    threshold = torch.maximum(tau.unsqueeze(1), top_p_threshold(torch.where(e >= tau.unsqueeze(1), e, 0.0), need))
    last = draw(torch.where(e >= threshold, e, 0.0), u[:, MAX_ROUNDS])
    return torch.where(open_rows, last, result)
