"""Incremental detokenization: text deltas that are correct for multi-byte characters.

Decoding token by token breaks characters that span several byte-level tokens and drops
word-leading spaces in SentencePiece vocabularies. Each delta is the difference between
the decoding of a short window that ends at the new token and the same window without
it; a window that ends in an incomplete character (U+FFFD) waits for the next token.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 6  # prompt tokens kept as left context so the first output word keeps its space


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset :])
        if window_text.endswith("\ufffd") or len(window_text) <= len(prefix_text):
            return ""  # an incomplete character, or a token that decodes to nothing (special)
        delta = window_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
