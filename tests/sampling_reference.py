"""The sampler's filters written the slow, obvious way (engine/sampler.py states the order): float64
weights, a full sort, each rule as its docstring words it. Tests hold the CPU kernel and the tensor
path to the distribution this gives."""

from __future__ import annotations

import math
from itertools import groupby

from pagecli.config import SamplingParams


def reference_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """The probability of each token after temperature, top-k, top-p and min-p (all zero: nothing drawable)."""
    x = [-math.inf if math.isnan(v) else v for v in logits]
    top = max(x)
    if top == -math.inf:
        return [0.0] * len(x)
    if top == math.inf:
        e = [1.0 if v == math.inf else 0.0 for v in x]
        return [w / sum(e) for w in e]
    e = [math.exp((v - top) / params.temperature) for v in x]
    floor = params.min_p
    kept = list(e)
    if 0 < params.top_k < len(e):
        kth = sorted(e, reverse=True)[params.top_k - 1]
        kept = [w if w >= kth else 0.0 for w in e]
        floor = max(floor, kth)
    if params.top_p < 1.0:
        need = params.top_p * sum(kept)
        reached = 0.0
        for value, ties in groupby(sorted(kept, reverse=True)):  # each distinct weight with all its ties
            reached += value * len(list(ties))
            if reached >= need:
                floor = max(floor, value)
                break
    weights = [w if w >= floor else 0.0 for w in e]
    total = sum(weights)
    return [w / total for w in weights]
