"""Incremental detokenization: text deltas that are correct for multi-byte characters.

Decoding token by token breaks characters that span several byte-level tokens and drops
word-leading spaces in SentencePiece vocabularies. Each delta is the difference between
the decoding of a short window that ends at the new token and the same window without
it; a window that ends in an incomplete character (U+FFFD) waits for the next token.
With a Rust `tokenizers` tokenizer behind the tokenizer (pagecli's own, or a fast one of
transformers), its `DecodeStream` does exactly that in one call a token (measured 1.6 us a
token against 10 for two Python-level decodes); otherwise the windows are decoded here. A
DecodeStream refuses a window whose decoding no longer starts with what it already gave
("Invalid prefix": bytes that are not UTF-8, as a byte-fallback vocabulary's <0xD0> <0xEC>,
decode to U+FFFD one way alone and another with what follows); the sequence then goes on with
the windows, from the last token whose text was given.
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # an old tokenizers: the windows are decoded here
    Tokenizer = DecodeStream = None  # type: ignore[assignment,misc]

_CONTEXT_TOKENS = 6  # prompt tokens kept as left context so the first output word keeps its space


def _rust_tokenizer(tokenizer: Any) -> Any:
    if Tokenizer is None:
        return None
    for name in ("backend", "backend_tokenizer"):  # pagecli's PlainTokenizer; a fast one of transformers
        backend = getattr(tokenizer, name, None)
        if isinstance(backend, Tokenizer):
            return backend
    return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._rust = _rust_tokenizer(tokenizer)
        self._stream = None
        if self._rust is not None:
            try:
                self._stream = DecodeStream(ids=list(self.ids), skip_special_tokens=True)
            except TypeError:  # a DecodeStream without a left context
                self._rust = None

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._rust, token_id) or ""
            except Exception:  # noqa: BLE001 - tokenizers raises a plain Exception ("Invalid prefix ...")
                self._stream = None  # the windows from here (module docstring)
            else:
                if delta:  # every token so far is in the text given
                    self.prefix_offset, self.read_offset = max(0, len(self.ids) - _CONTEXT_TOKENS), len(self.ids)
                self.text += delta
                return delta
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
