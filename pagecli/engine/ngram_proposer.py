"""Prompt lookup: draft tokens for speculative decoding copied from the sequence's own tokens.

The newest n tokens (n from `max_ngram` down to `min_ngram`) are looked for earlier in the sequence,
prompt and output alike; the tokens that followed the latest earlier occurrence are proposed as the
next ones. Editing, summarizing and answering over a document repeat their input, so proposals are
often right there; where nothing matches, nothing is proposed and the step is a plain decode.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf


class NgramIndex:
    """Prompt lookup for one growing sequence, without a scan: the latest start of every n-gram
    (min_ngram <= n <= max_ngram) among the tokens before the last, added as the sequence grows, so a
    proposal costs a few dictionary lookups at any length; only the last `window` tokens count. Its
    proposals equal a backward scan's (tests/test_speculation.py holds that scan as the reference)."""

    __slots__ = ("max_ngram", "min_ngram", "window", "latest", "indexed")

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, window: int = 4096) -> None:
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start
        self.indexed = 0  # the n-grams ending before this position are in

    def propose(self, token_ids: SequenceOf[int], max_tokens: int) -> list[int]:
        total = len(token_ids)
        if total < self.indexed:  # the tokens were cut back: start again
            self.latest.clear()
            self.indexed = 0
        for end in range(self.indexed, total - 1):  # n-grams ending at `end` (the last token's are not matches)
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self.latest[tuple(token_ids[end + 1 - n : end + 1])] = end + 1 - n
        self.indexed = max(self.indexed, total - 1)
        if max_tokens <= 0 or total < self.min_ngram + 1:
            return []
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            at = self.latest.get(tuple(token_ids[total - n :]))
            if at is not None and at >= total - self.window:
                return list(token_ids[at + n : at + n + max_tokens])
        return []
