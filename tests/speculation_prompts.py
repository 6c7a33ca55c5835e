"""Prompts the speculation tests share: they repeat themselves, so a random model's greedy output (which loops)
and the drafts meet."""

from pagecli.config import SamplingParams

PROMPTS = [
    "one two three four five six seven one two three four five six seven one two three",
    "Paged attention keeps the KV cache in fixed-size blocks. " * 4,
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n" * 2,
    "fox",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
