"""Truncating a long conversation costs a few renders, not one per dropped turn: `chat --resume` of a
3,000-turn session answers at once, and the turns dropped are still the fewest that fit."""

from __future__ import annotations

import json
import time

import pytest
from chat_helpers import cli_args, make_engine, run_cli

from pagecli.chat import session as sessions
from pagecli.chat.conversation import Conversation, Turn
from pagecli.chat.prompt import PromptBuilder
from pagecli.chat.truncation import _REFILL_FRACTION, fit_prompt

WORDS = "paged attention keeps the cache in fixed size blocks and reuses every cached prefix".split()


def long_conversation(turns: int) -> Conversation:
    conversation = Conversation(system="Be brief.")
    for i in range(turns):
        user = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 7))
        conversation.turns.append(Turn(f"{i}: {user}", f"reply {i} " + WORDS[i % len(WORDS)] * (i % 3)))
    conversation.turns_total = turns
    return conversation


class CountingBuilder(PromptBuilder):
    renders = 0

    def render(self, messages):
        CountingBuilder.renders += 1
        return super().render(messages)


@pytest.mark.parametrize("turns", [40, 400, 3000])
def test_the_fewest_oldest_turns_are_dropped_with_a_few_renders(tiny_llama, turns):
    engine = make_engine(tiny_llama, max_model_len=256)
    builder = CountingBuilder(engine)
    conversation = long_conversation(turns)
    CountingBuilder.renders = 0
    fitted = fit_prompt(conversation, "and now?", builder, engine.fingerprint if hasattr(engine, "fingerprint")
                        else "", 256, 32, truncate=True)
    renders = CountingBuilder.renders
    target = int((256 - 32) * _REFILL_FRACTION)
    assert len(fitted.prompt.token_ids) <= target and fitted.dropped_turns > 0
    one_fewer = builder.build(conversation.messages("and now?", skip_turns=fitted.dropped_turns - 1))
    assert len(one_fewer.token_ids) > target, "not one turn more than needed was dropped"
    assert renders <= 2 + 2 * max(turns, 2).bit_length(), f"{renders} renders for {turns} turns"


def test_chat_resume_of_a_3000_turn_session_answers_at_once(tiny_llama, capsys, monkeypatch):
    """Reproducer: `chat --resume` of a 3,000-turn session did not answer in 120 s (one render and
    tokenization of the whole conversation per dropped turn)."""
    sessions.save_session("long", long_conversation(3000), str(tiny_llama))
    start = time.monotonic()
    code, out, err = run_cli(cli_args(tiny_llama, "--resume", "long", "--max-model-len", "256", "--jsonl"),
                             "one more question\n", capsys, monkeypatch)
    elapsed_s = time.monotonic() - start
    assert code == 0, err
    [record] = [json.loads(line) for line in out.splitlines()]
    assert record["dropped_turns"] > 2900
    assert elapsed_s < 30, f"{elapsed_s:.1f} s"
