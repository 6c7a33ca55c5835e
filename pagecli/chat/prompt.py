"""Chat prompts as token ids, built so that turn N+1 starts with exactly the ids of turn N.

The chat template renders the whole conversation as text. When that text starts with a
known prefix (the previous prompt plus the reply the model generated), the prompt is the
known ids followed by the tokenization of the rest only. Re-tokenizing the reply could give
other ids than the ones generated, and then its blocks would miss the prefix cache. When a
template re-renders history differently (say, it strips earlier reasoning), a shorter known
prefix (the previous prompt) or none matches and more text is tokenized afresh; the engine
still reuses the longest matching block prefix, and the per-turn figures show honestly how
much that was.

A conversation the template or the tokenizer cannot take is a RequestError, worded by
`request_failure` as for every other request: the chat says so and goes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagecli.chat.conversation import KnownPrefix
from pagecli.errors import RequestError, request_error_of
from pagecli.models.chat_template import apply_chat_template

# Raised by a template's own expressions on some conversations ({{ 1 / 0 }}, {{ text + 1 }}): the
# template is at fault, and only for this conversation, so the chat goes on.
_TEMPLATE_BUGS = (TypeError, ValueError, ArithmeticError, LookupError)


@dataclass(frozen=True)
class BuiltPrompt:
    text: str | None  # the rendered template; None for a model without a chat template
    token_ids: tuple[int, ...]
    known_tokens: int  # leading ids taken from a known prefix rather than tokenized now
    known_text: str = ""  # the text of those ids


class PromptBuilder:
    """Renders messages with the engine's tokenizer and chat template; knows no tensors."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.has_template = bool(getattr(engine, "chat_template", None))

    def render(self, messages: list[dict[str, str]]) -> str:
        try:
            return apply_chat_template(self.tokenizer, messages)
        except Exception as exc:  # noqa: BLE001 - sorted by request_error_of: this conversation's fault or a bug
            error = request_error_of(exc, "the chat template failed on this conversation", _TEMPLATE_BUGS)
            if error is None:
                raise
            has_system = any(m.get("role") == "system" for m in messages)
            hint = "; if the model takes no system prompt, /system - removes it" if has_system else ""
            raise RequestError(_sentence(f"{error}{hint}")) from exc

    def tokenize(self, text: str) -> list[int]:
        # The template writes the special tokens itself, so the tokenizer must not add any.
        try:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        except Exception as exc:  # noqa: BLE001 - sorted by request_error_of, as Engine.encode does
            error = request_error_of(exc, "the message could not be tokenized", (TypeError, ValueError))
            if error is None:
                raise
            raise RequestError(_sentence(str(error))) from exc

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def build(self, messages: list[dict[str, str]], known: Sequence[KnownPrefix] = ()) -> BuiltPrompt:
        if not self.has_template:
            return BuiltPrompt(None, tuple(self.engine.encode_chat(messages)), 0)
        text = self.render(messages)
        for prefix in known:  # longest first
            if prefix.token_ids and text.startswith(prefix.text):  # equal: /retry sends the same prompt again
                rest = self.tokenize(text[len(prefix.text):]) if len(text) > len(prefix.text) else []
                return BuiltPrompt(text, prefix.token_ids + tuple(rest), len(prefix.token_ids), prefix.text)
        return BuiltPrompt(text, tuple(self.tokenize(text)), 0)

    def prefixes_after_reply(self, prompt: BuiltPrompt, reply_text: str,
                             reply_token_ids: Sequence[int]) -> list[KnownPrefix]:
        """What the next prompt may start with: the prompt, and the prompt plus the longest run of reply
        ids that decodes to a prefix of the reply text (all of them, unless the reply was cut by a stop
        string, stopped mid-character, or holds special tokens the text leaves out); and the known prefix
        this prompt was built on, which is where the conversation stands again after /undo."""
        if prompt.text is None:
            return []
        prefixes = [KnownPrefix(prompt.text, prompt.token_ids)]
        if 0 < prompt.known_tokens < len(prompt.token_ids):
            prefixes.append(KnownPrefix(prompt.known_text, prompt.token_ids[:prompt.known_tokens]))
        count = self._longest_decoding_prefix(reply_token_ids, reply_text)
        if count:
            text = self.decode(reply_token_ids[:count])
            prefixes.append(KnownPrefix(prompt.text + text, prompt.token_ids + tuple(reply_token_ids[:count])))
        return prefixes

    def _longest_decoding_prefix(self, token_ids: Sequence[int], text: str) -> int:
        """A large k (all ids when possible) such that the first k ids decode to a prefix of text.

        Bisection needs O(log n) decodes; the predicate is not strictly monotone (a cut inside a
        multi-byte character fails), so the k found may fall short of the best, never past a valid one.
        """
        def fits(k: int) -> bool:
            return text.startswith(self.decode(token_ids[:k]))

        if not token_ids or fits(len(token_ids)):
            return len(token_ids)
        low, high = 0, len(token_ids)  # fits(low) holds (the empty decode), fits(high) does not
        while high - low > 1:
            mid = (low + high) // 2
            if fits(mid):
                low = mid
            else:
                high = mid
        return low


def _sentence(message: str) -> str:
    """A failure as the chat prints it: capitalized, ending with a full stop."""
    message = message[:1].upper() + message[1:]
    return message if message.endswith((".", "!", "?")) else message + "."
