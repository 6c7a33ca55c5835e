"""Sampling filters, settings validation, and incremental detokenization of multi-byte text."""

from __future__ import annotations

import random

import pytest
import torch

from pagecli.config import SamplingParams
from pagecli.engine.detokenizer import IncrementalDetokenizer
from pagecli.engine.sampler import apply_repetition_penalty
from pagecli.engine.sampler_torch import draw, kept_weights
from pagecli.errors import PagecliError


def draw_rows(weights: torch.Tensor, uniforms: list[float]) -> list[int]:
    return draw(weights, torch.tensor(uniforms, dtype=torch.float64)).tolist()


def kept(logits: list[float], params: SamplingParams) -> list[bool]:
    return (kept_weights(torch.tensor([logits]), [params])[0] > 0).tolist()


def test_top_k_keeps_only_the_k_most_likely():
    assert kept([1.0, 4.0, 3.0, 2.0], SamplingParams(temperature=1.0, top_k=2)) == [False, True, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).tolist()
    assert kept(logits, SamplingParams(temperature=1.0, top_p=0.7)) == [True, True, False, False]


def test_min_p_drops_tokens_below_a_share_of_the_best():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.06, 0.04])).tolist()
    assert kept(logits, SamplingParams(temperature=1.0, min_p=0.2)) == [True, True, False, False]


def test_a_draw_follows_the_distribution_and_never_picks_a_token_of_probability_zero():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    rng = random.Random(0)
    tokens = draw_rows(probs.expand(20000, -1), [rng.random() for _ in range(20000)])
    counts = torch.bincount(torch.tensor(tokens), minlength=5)
    assert counts[1] == 0 and counts[4] == 0
    torch.testing.assert_close(counts.double() / 20000, probs.double(), atol=0.012, rtol=0)


def test_rows_drawn_together_get_what_each_gets_alone():
    # Sampled rows of a step are drawn together; a seeded request must not depend on its batch. A
    # vocabulary that is not a whole number of the draw's chunks, peaked and flat rows, zeros.
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(48, 1000, generator=gen) * torch.tensor([0.1, 3.0, 30.0]).repeat(16)[:, None]
    logits[::5, 500:] = float("-inf")
    probs = logits.softmax(dim=-1)
    uniforms = [random.Random(i).random() for i in range(48)]
    together = draw_rows(probs, uniforms)
    alone = [draw_rows(probs[i : i + 1], [uniforms[i]])[0] for i in range(48)]
    assert together == alone
    assert all(probs[i, token] > 0 for i, token in enumerate(together))


def test_a_draw_past_the_last_cumulative_probability_takes_the_last_possible_token():
    # u * total can round up to the total; no cumulative probability is then above it.
    assert draw_rows(torch.tensor([[0.25, 0.75, 0.0, 0.0]]), [1.0]) == [1]


def test_repetition_penalty_lowers_seen_tokens_both_signs():
    out = apply_repetition_penalty(torch.tensor([2.0, -2.0, 1.0]), [0, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


@pytest.mark.parametrize("bad", [
    dict(temperature=-1), dict(top_p=2), dict(top_p=0), dict(max_tokens=0), dict(top_k=-1),
    dict(min_p=1.5), dict(repetition_penalty=0),
])
def test_absurd_sampling_values_are_refused_with_a_sentence(bad):
    with pytest.raises(PagecliError, match="must be"):
        SamplingParams(**bad)


@pytest.mark.parametrize("rust_stream", [True, False], ids=["DecodeStream", "windows"])
def test_detokenizer_streams_multibyte_characters_whole(tiny_llama, rust_stream, monkeypatch):
    from transformers import AutoTokenizer

    from pagecli.engine import detokenizer

    if not rust_stream:
        monkeypatch.setattr(detokenizer, "_rust_tokenizer", lambda tokenizer: None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    text = " Très bien, 日本語のテキスト 🚀 naïve"
    ids = tokenizer(text)["input_ids"]
    prompt = tokenizer("Hello world")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert (detok._stream is not None) == rust_stream
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0, "some tokens are partial characters and must wait"


def test_both_detokenizers_give_the_same_deltas_on_the_embedded_tokenizer(monkeypatch):
    from pagecli.engine import detokenizer
    from pagecli.models.source import prepare_default_model
    from pagecli.models.tokenizer import load_plain_tokenizer

    tokenizer = load_plain_tokenizer(prepare_default_model())
    text = "Paged attention, über naïve 日本語のテキスト 🚀.\n\n  def f(x):\n\treturn x  " * 3
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids.insert(20, tokenizer.eos_token_id)  # a special token decodes to nothing
    prompt = tokenizer.encode("You said:", add_special_tokens=False)
    stream = IncrementalDetokenizer(tokenizer, prompt)
    assert stream._stream is not None
    monkeypatch.setattr(detokenizer, "_rust_tokenizer", lambda tokenizer: None)
    windows = IncrementalDetokenizer(tokenizer, prompt)
    assert [stream.add(i) for i in ids] == [windows.add(i) for i in ids]


def test_bytes_that_are_not_utf8_do_not_stop_the_stream(monkeypatch):
    """A byte-fallback vocabulary's lone bytes (<0xD0> <0xEC>) can make tokenizers' DecodeStream refuse a window
    ("Invalid prefix encountered while decoding stream": a random model emitted them and generate stopped); the
    detokenizer then goes on with the windows and gives what they give."""
    import random

    from tokenizers import Tokenizer, decoders, models

    from pagecli.engine import detokenizer

    vocab = {"<unk>": 0, "a": 1, ",": 2, ":": 3, "A": 4, "▁": 5, "▁a": 6}
    vocab.update({f"<0x{byte:02X}>": 7 + byte for byte in range(256)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])

    class ByteFallbackTokenizer:
        def __init__(self):
            self.backend = backend

        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    rng = random.Random(0)
    cases = [([44, 33, 43, 101, 113], [31, 197, 4, 50, 201, 148, 229, 250])]  # one that failed
    cases += [([rng.randrange(len(vocab)) for _ in range(rng.randrange(6))],
               [rng.randrange(len(vocab)) for _ in range(8)]) for _ in range(300)]
    fell_back = 0
    for context, generated in cases:
        stream = detokenizer.IncrementalDetokenizer(ByteFallbackTokenizer(), context)
        assert stream._stream is not None
        deltas = [stream.add(token) for token in generated]  # raised before
        fell_back += stream._stream is None
        assert "".join(deltas) == stream.text
        letters = [token for token in generated if token in (1, 2, 3, 4)]
        assert stream.text.count("A") + stream.text.count("a") >= sum(1 for t in letters if t in (1, 4)) - 1
    assert fell_back >= 2, "no case made the stream refuse a window: the test checks nothing"
