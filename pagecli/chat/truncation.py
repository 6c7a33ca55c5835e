"""Keeping a conversation inside max_model_len: drop the oldest turns, never the system prompt.

A prompt must leave room for a reply of `reply_reserve_tokens(...)` tokens. When it does not,
the oldest turns go until the prompt fits in three quarters of that room (not just barely),
so the next few turns keep the same history prefix and keep hitting the prefix cache instead
of re-prefilling after every single drop.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagecli.chat.conversation import Conversation
from pagecli.chat.prompt import BuiltPrompt, PromptBuilder
from pagecli.errors import PagecliError

_REFILL_FRACTION = 0.75  # after a drop, the prompt uses at most this share of the room


class ContextFull(PagecliError):
    """The next prompt does not fit the model's context."""


@dataclass(frozen=True)
class FittedPrompt:
    prompt: BuiltPrompt
    dropped_turns: int  # oldest turns to drop from the conversation before sending this prompt


def reply_reserve_tokens(max_tokens: int, max_model_len: int) -> int:
    """Room kept for the reply: max_tokens, but never more than a quarter of the context."""
    return max(1, min(max_tokens, max_model_len // 4))


def fit_prompt(conversation: Conversation, user_text: str, builder: PromptBuilder, known_fingerprint: str,
               max_model_len: int, reserve_tokens: int, truncate: bool) -> FittedPrompt:
    """The prompt for `user_text`, with the oldest turns dropped if needed; ContextFull when it cannot fit."""
    room = max_model_len - reserve_tokens
    known = conversation.prefixes_for(known_fingerprint)
    prompt = builder.build(conversation.messages(user_text), known)
    if len(prompt.token_ids) <= room:
        return FittedPrompt(prompt, 0)
    if not truncate:
        raise ContextFull(
            f"The conversation would be {len(prompt.token_ids)} tokens, more than the {room} this model takes "
            f"(max_model_len {max_model_len}, {reserve_tokens} kept for the reply); use /reset, or run without "
            "--no-truncate to drop the oldest turns."
        )
    target = int(room * _REFILL_FRACTION)
    dropped = 0
    while dropped < len(conversation.turns) and len(prompt.token_ids) > target:
        dropped += 1
        prompt = builder.build(conversation.messages(user_text, skip_turns=dropped), known)
    if len(prompt.token_ids) > room:
        raise ContextFull(
            f"This message is too long: {len(prompt.token_ids)} tokens with the system prompt, and this model "
            f"takes {room} (max_model_len {max_model_len}, {reserve_tokens} kept for the reply); shorten it."
        )
    return FittedPrompt(prompt, dropped)
