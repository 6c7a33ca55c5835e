"""Prompt lookup: draft tokens for speculative decoding copied from the sequence's own tokens.

The newest n tokens (n from `max_ngram` down to `min_ngram`) are looked for earlier in the sequence,
prompt and output alike; the tokens that followed the latest earlier occurrence are proposed as the
next ones. Editing, summarizing and answering over a document repeat their input, so proposals are
often right there; where nothing matches, nothing is proposed and the step is a plain decode.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf


def propose(token_ids: SequenceOf[int], max_tokens: int, max_ngram: int = 3, min_ngram: int = 1,
            window: int = 4096) -> list[int]:
    """Up to max_tokens drafts following the latest earlier occurrence of the longest matching suffix
    n-gram; [] if none. Only the last `window` tokens are searched (a bound on the cost per step)."""
    total = len(token_ids)
    if max_tokens <= 0 or total < min_ngram + 1:
        return []
    start = max(0, total - window)
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        suffix = list(token_ids[total - n :])
        first = suffix[0]
        # the latest occurrence that ends before the suffix itself starts overlapping the end
        for at in range(total - n - 1, start - 1, -1):
            if token_ids[at] == first and list(token_ids[at : at + n]) == suffix:
                follow = list(token_ids[at + n : at + n + max_tokens])
                if follow:
                    return follow
    return []
