"""Prompt lookup: draft tokens for speculative decoding copied from the sequence's own tokens.

The newest n tokens (n from `max_ngram` down to `min_ngram`) are looked for earlier in the sequence,
prompt and output alike; the tokens that followed the latest earlier occurrence are proposed as the
next ones. Editing, summarizing and answering over a document repeat their input, so proposals are
often right there; where nothing matches, nothing is proposed and the step is a plain decode.

Once a proposal is made, the place it was copied from is kept (a copy cursor): while the tokens the
sequence gains are the ones that followed that place, the next proposal goes on from there, and the
lookup is asked again only where the output leaves its source. A short n-gram is ambiguous in code and
prose alike (an indentation, `self.`, `the`): its latest occurrence is often another line than the one
being copied. On the editing set's greedy outputs (scripts/bench_speculation.py's workload), replayed
through the draft budget with a row costing 0.21 of a step (Zen 4; scripts/replay_lookup.py), the cursor
raised the expected tokens per unit of step cost from 1.88 to 2.00 (latest occurrence with up to 8-grams:
1.96); measured, the editing set's decode rose 12% (docs/benchmarks/speculation.md).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf


class NgramIndex:
    """Prompt lookup for one growing sequence, without a scan: the latest start of every n-gram
    (min_ngram <= n <= max_ngram) among the tokens before the last, added as the sequence grows, so a
    proposal costs a few dictionary lookups at any length; only the last `window` tokens count. And the
    copy cursor (module docstring): `source` is where the last proposal was copied from, made when the
    sequence had `proposed_at` tokens. Its proposals equal a backward scan's with the same cursor
    (tests/test_speculation.py holds that scan as the reference)."""

    __slots__ = ("max_ngram", "min_ngram", "window", "latest", "indexed", "proposed_at", "source")

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, window: int = 4096) -> None:
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start
        self.indexed = 0  # the n-grams ending before this position are in
        self.proposed_at = self.source = -1  # no cursor

    def propose(self, token_ids: SequenceOf[int], max_tokens: int) -> list[int]:
        total = len(token_ids)
        if total < self.indexed:  # the tokens were cut back: start again
            self.latest.clear()
            self.indexed = 0
            self.proposed_at = self.source = -1
        for end in range(self.indexed, total - 1):  # n-grams ending at `end` (the last token's are not matches)
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self.latest[tuple(token_ids[end + 1 - n : end + 1])] = end + 1 - n
        self.indexed = max(self.indexed, total - 1)
        if max_tokens <= 0 or total < self.min_ngram + 1:
            return []
        at = self._followed(token_ids)
        if at < 0:
            at = self._lookup(token_ids)
        if at < 0:
            self.proposed_at = self.source = -1
            return []
        self.proposed_at, self.source = total, at
        return list(token_ids[at : at + max_tokens])

    def _followed(self, token_ids: SequenceOf[int]) -> int:
        """Where the copy goes on, when every token the sequence gained since the last proposal is the one that
        followed its source there (and the source has more, inside the window), else -1."""
        if self.proposed_at < 0:
            return -1
        total = len(token_ids)
        gained = total - self.proposed_at
        at = self.source + gained
        if gained < 0 or at >= total or at < total - self.window:
            return -1
        same = all(token_ids[self.proposed_at + i] == token_ids[self.source + i] for i in range(gained))
        return at if same else -1

    def _lookup(self, token_ids: SequenceOf[int]) -> int:
        """Where the tokens after the latest earlier occurrence of the longest matching suffix start, or -1."""
        total = len(token_ids)
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            at = self.latest.get(tuple(token_ids[total - n :]))
            if at is not None and at >= total - self.window:
                return at + n
        return -1
