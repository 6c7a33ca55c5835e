"""Keeping a conversation inside max_model_len: drop the oldest turns, never the system prompt.

A prompt must leave room for a reply of `reply_reserve_tokens(...)` tokens. When it does not,
the oldest turns go until the prompt fits in three quarters of that room (not just barely),
so the next few turns keep the same history prefix and keep hitting the prefix cache instead
of re-prefilling after every single drop. Finding how many turns to drop costs a few renders, not
one per dropped turn: a guess from each turn's share of the text, then a galloping search (the
prompt only shrinks as turns go), so a 3,000-turn session resumes at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagecli.chat.conversation import Conversation, KnownPrefix
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
    prompt, dropped = _drop_oldest_until(int(room * _REFILL_FRACTION), conversation, user_text, builder, known,
                                         prompt)
    if len(prompt.token_ids) > room:
        raise ContextFull(
            f"This message is too long: {len(prompt.token_ids)} tokens with the system prompt, and this model "
            f"takes {room} (max_model_len {max_model_len}, {reserve_tokens} kept for the reply); shorten it."
        )
    return FittedPrompt(prompt, dropped)


def _drop_oldest_until(target: int, conversation: Conversation, user_text: str, builder: PromptBuilder,
                       known: Sequence[KnownPrefix], full: BuiltPrompt) -> tuple[BuiltPrompt, int]:
    """The prompt with the fewest oldest turns dropped that has at most `target` tokens (or with every turn
    dropped), and that count. `full` (nothing dropped) is over `target`. The prompt shrinks as turns go, so
    a galloping search from a guess finds the count in O(log error) renders."""
    built: dict[int, BuiltPrompt] = {0: full}
    turns = len(conversation.turns)
    if not turns:
        return full, 0

    def fits(dropped: int) -> bool:
        if dropped not in built:
            built[dropped] = builder.build(conversation.messages(user_text, skip_turns=dropped), known)
        return len(built[dropped].token_ids) <= target

    low, high = _bracket(fits, _guess_turns_to_drop(conversation, user_text, full, target), turns)
    while high - low > 1:  # fits(low) is False (or low is 0), the answer is at most high
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    fits(high)  # builds it if the search never did (every turn dropped)
    return built[high], high


def _bracket(fits: Callable[[int], bool], guess: int, turns: int) -> tuple[int, int]:
    """(low, high) with the answer in (low, high], by steps doubling away from `guess`."""
    step = 1
    if fits(guess):
        high = guess
        while high - step > 0 and fits(high - step):
            high -= step
            step *= 2
        return max(high - step, 0), high
    low = guess
    while low + step < turns and not fits(low + step):
        low += step
        step *= 2
    return low, min(low + step, turns)


def _guess_turns_to_drop(conversation: Conversation, user_text: str, full: BuiltPrompt, target: int) -> int:
    """How many oldest turns hold the prompt's tokens past `target`, counting each turn's share of the text
    (its messages plus the template's average markup per turn) at the prompt's tokens per character."""
    turns = conversation.turns
    content = [len(t.user) + len(t.assistant) for t in turns]
    text_chars = len(full.text) if full.text is not None else sum(content) + len(user_text)
    markup = max(0, text_chars - sum(content) - len(conversation.system or "") - len(user_text)) / len(turns)
    tokens_per_char = len(full.token_ids) / max(text_chars, 1)
    excess = len(full.token_ids) - target
    removed = 0.0
    for count, chars in enumerate(content, start=1):
        removed += (chars + markup) * tokens_per_char
        if removed >= excess:
            return count
    return len(turns)
