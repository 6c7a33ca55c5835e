"""Built-in `bench run` workloads, deterministic from a seed, with prompts of plain English-like text.

- mixed: 64 independent requests whose prompts run from a sentence to a few pages (about 15 to
  700 tokens: mostly short, a long tail) with 8 to 64 output tokens each;
- shared-prefix: one long system prompt (SHARED_SYSTEM_SENTENCES sentences, about 520 SmolLM2 tokens; or
  `system_sentences`) shared by 32 short questions;
- chat: one 8-turn conversation; each turn resends the whole history plus a new user message,
  so turn N reuses the KV of turns 1..N-1 from the prefix cache.

Built-in requests ignore end-of-sequence tokens and always produce their full output length,
so two runs do the same amount of work whatever the model says. On a CPU the command line runs
a smaller size by default (CPU_COUNTS requests, CPU_MAX_TOKENS output tokens each), because a
CPU prefills a few hundred tokens per second at best.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from pagecli.config import SamplingParams
from pagecli.errors import PagecliError

Prompt = str | tuple[dict[str, str], ...]


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt: Prompt  # plain text, or chat messages (a conversation's user turn: its one user message)
    sampling: SamplingParams


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]
    # A conversation runs its requests one after another; each prompt is the system prompt, every
    # earlier user message and reply, then its own user message. Otherwise all arrive at once.
    conversation: bool = False
    system_prompt: str | None = None


@dataclass(frozen=True)
class _Shape:
    default_count: int
    cpu_count: int  # the CPU default: small enough to finish in well under a minute on two cores
    description: str


BUILTIN_WORKLOADS: dict[str, _Shape] = {
    "mixed": _Shape(64, 8, "independent requests of mixed length, all arriving at once"),
    "shared-prefix": _Shape(32, 8, "one long system prompt shared by many short questions"),
    "chat": _Shape(8, 4, "an 8-turn conversation, each turn resending the history"),
}
CPU_MAX_TOKENS = 16
SHARED_SYSTEM_SENTENCES = 40  # shared-prefix's system prompt: about 13 SmolLM2 tokens a sentence

_SUBJECTS = ("the engineer", "our team", "the old library", "a small bakery", "the city council", "my neighbour",
             "the research group", "a quiet student", "the shipping company", "the museum", "every visitor",
             "the new manager", "a local farmer", "the orchestra", "the hospital", "the village school")
_VERBS = ("reviewed", "planned", "described", "repaired", "measured", "organised", "questioned", "painted",
          "moved", "borrowed", "explained", "changed", "visited", "counted", "photographed", "improved")
_OBJECTS = ("the quarterly report", "a wooden bridge", "the morning schedule", "several broken chairs",
            "the river path", "an unusual recipe", "the budget for next year", "the long corridor",
            "a map of the valley", "the storage room", "the evening concert", "a set of old letters",
            "the train timetable", "the garden fence", "a list of questions", "the main entrance")
_CLAUSES = ("before the meeting started", "after a long week", "because the weather was calm",
            "while everyone waited outside", "during the spring festival", "with great care",
            "in less than an hour", "for the first time", "without asking for help", "as the sun went down",
            "despite the heavy rain", "near the harbour", "at the end of the day", "on a busy Tuesday")
_INSTRUCTIONS = ("Summarise the following notes in a few sentences.", "Continue the story below.",
                 "List the main events described here.", "Rewrite this passage in simpler words.",
                 "What is the most surprising detail in the text below?")
_QUESTIONS = ("What should I bring to {obj}?", "How long does it take to visit {obj}?",
              "Who is responsible for {obj}?", "Can you explain {obj} to a child?",
              "Why did {subj} change {obj}?", "When is the best time to see {obj}?",
              "What happened to {obj} last year?", "How can {subj} improve {obj}?")
_CHAT_OPENERS = ("Tell me about {obj}.", "Why does {subj} care about {obj}?", "Give me one more example.",
                 "Can you make that shorter?", "What would {subj} say about that?", "Explain it step by step.",
                 "What is a common mistake here?", "Summarise our conversation so far.")


def sentence(rng: random.Random) -> str:
    text = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_CLAUSES)}."
    return text[0].upper() + text[1:]


def paragraph(rng: random.Random, num_sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(num_sentences))


def _mixed_sentence_count(rng: random.Random) -> int:
    """Mostly short prompts with a long tail: 1-4 sentences (60%), 5-16 (30%), 17-48 (10%)."""
    roll = rng.random()
    if roll < 0.6:
        return rng.randint(1, 4)
    return rng.randint(5, 16) if roll < 0.9 else rng.randint(17, 48)


def builtin_workload(name: str, base: SamplingParams, count: int | None = None, max_tokens: int | None = None,
                     seed: int = 0, system_sentences: int = SHARED_SYSTEM_SENTENCES) -> Workload:
    """Workload `name` with `count` requests (turns, for chat); `max_tokens` overrides every output length;
    `system_sentences` sizes shared-prefix's system prompt (a longer one starts with the shorter one's text)."""
    if name not in BUILTIN_WORKLOADS:
        raise PagecliError(f"Unknown workload '{name}'; choose {', '.join(BUILTIN_WORKLOADS)} or pass a JSONL file.")
    count = BUILTIN_WORKLOADS[name].default_count if count is None else count
    if count < 1:
        raise PagecliError(f"--count must be at least 1 (got {count}).")
    if system_sentences < 1:
        raise PagecliError(f"The system prompt needs at least 1 sentence (got {system_sentences}).")
    rng = random.Random(f"{name}:{seed}")

    def sampling(default_tokens: int) -> SamplingParams:
        return replace(base, max_tokens=max_tokens or default_tokens, ignore_eos=True)

    if name == "mixed":
        requests = tuple(
            BenchRequest(f"mixed-{i}", f"{rng.choice(_INSTRUCTIONS)}\n\n{paragraph(rng, _mixed_sentence_count(rng))}",
                         sampling(rng.randint(8, 64)))
            for i in range(count)
        )
        return Workload(name, requests)
    if name == "shared-prefix":
        system = "You are a helpful guide for the following town notes.\n\n" + paragraph(rng, system_sentences)
        requests = tuple(
            BenchRequest(f"shared-prefix-{i}", _messages(system, _fill(rng.choice(_QUESTIONS), rng)),
                         sampling(rng.randint(16, 32)))
            for i in range(count)
        )
        return Workload(name, requests)
    system = "You are a patient assistant who answers in plain words."
    requests = tuple(
        BenchRequest(f"chat-turn-{i + 1}", ({"role": "user", "content": _chat_message(rng, i)},), sampling(32))
        for i in range(count)
    )
    return Workload(name, requests, conversation=True, system_prompt=system)


def _messages(system: str, user: str) -> tuple[dict[str, str], ...]:
    return ({"role": "system", "content": system}, {"role": "user", "content": user})


def _fill(template: str, rng: random.Random) -> str:
    return template.format(subj=rng.choice(_SUBJECTS), obj=rng.choice(_OBJECTS))


def _chat_message(rng: random.Random, turn: int) -> str:
    opener = _fill(_CHAT_OPENERS[turn % len(_CHAT_OPENERS)], rng)
    return f"{opener} {paragraph(rng, rng.randint(1, 3))}" if turn == 0 else opener


def conversation_prompt(workload: Workload, turn: int, replies: list[str]) -> list[dict[str, Any]]:
    """The messages turn `turn` of a conversation sends: system prompt, the history so far, its own message."""
    messages: list[dict[str, Any]] = []
    if workload.system_prompt:
        messages.append({"role": "system", "content": workload.system_prompt})
    for earlier, reply in zip(workload.requests[:turn], replies):
        messages.extend(dict(m) for m in earlier.prompt)  # type: ignore[union-attr]
        messages.append({"role": "assistant", "content": reply})
    messages.extend(dict(m) for m in workload.requests[turn].prompt)  # type: ignore[union-attr]
    return messages
