"""Beam search equals transformers' generate(num_beams=k, do_sample=False) on the same float32 weights.

Every returned beam (num_return_sequences = k), not only the best, must be token-for-token equal, in the
same order (best first), with the same stop tokens; sequence scores must agree within SCORE_ATOL. The
scores are sums of up to a dozen float32 log-probs divided by a length term; the engine's logits differ from
transformers' by under 1e-4 (test_model_parity.py), so 1e-3 is a stated bound with room, and the runs
below agree far closer than that.

The tiny models' end-of-sequence token is chosen as a token the model likes to produce (the third token
of its best beam), so hypotheses do finish early and length_penalty and early_stopping matter.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.loader import load_model
from tiny_models import ARCHS

SCORE_ATOL = 1e-3
NEVER_A_TOKEN = 1 << 30  # transformers' end-of-sequence id for a run with none (ignore_eos): it never matches
PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]  # 13 tokens: a partial last block of 4
SETTINGS = [(1.0, False), (2.0, "never"), (-1.0, True), (0.0, "never"), (0.5, False)]  # (length_penalty, early_stopping)


def engine_for(folder, **config) -> Engine:
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "block_size": 4, "num_blocks": 256,
                "disk_cache": False, **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))


def beam_params(width: int, max_tokens: int, length_penalty: float = 1.0, early_stopping: bool | str = False,
                n: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, beam_width=width, n=n or width,
                          length_penalty=length_penalty, early_stopping=early_stopping)


def transformers_beams(folder, prompt, stop_ids, width, max_tokens, length_penalty, early_stopping):
    """transformers' k returned beams: (generated tokens up to and with the first stop token, score)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, num_beams=width, do_sample=False,
                      num_return_sequences=width, length_penalty=length_penalty, early_stopping=early_stopping,
                      output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                      eos_token_id=sorted(stop_ids) or [NEVER_A_TOKEN])
    beams = []
    for sequence, score in zip(out.sequences, out.sequences_scores):
        tokens = sequence[len(prompt):].tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
        beams.append((tuple(tokens[:end]), float(score)))
    return beams


def assert_same_beams(ours, theirs) -> None:
    assert [c.token_ids for c in ours] == [tokens for tokens, _ in theirs]
    for completion, (_, score) in zip(ours, theirs):
        assert completion.score == pytest.approx(score, abs=SCORE_ATOL)


@pytest.fixture(scope="module")
def eos_models(tiny_model_factory):
    """arch -> a tiny model whose end-of-sequence token is the third token of its best beam without one."""
    models = {}
    for arch in ARCHS:
        engine = engine_for(tiny_model_factory(arch))
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, beam_width=4)
        [best] = engine.generate([PROMPT], params)
        models[arch] = tiny_model_factory(arch, eos_token_id=best.token_ids[2])
    return models


@pytest.mark.parametrize("arch", ARCHS)
def test_every_beam_and_score_equals_transformers(arch, eos_models):
    folder = eos_models[arch]
    engine = engine_for(folder)
    finish_reasons = set()
    for length_penalty, early_stopping in SETTINGS:
        for width in (2, 4):
            ours = engine.generate([PROMPT], beam_params(width, 10, length_penalty, early_stopping))
            theirs = transformers_beams(folder, PROMPT, engine.stop_token_ids, width, 10, length_penalty,
                                        early_stopping)
            assert_same_beams(ours, theirs)
            finish_reasons.update(c.finish_reason for c in ours)
    assert finish_reasons == {"stop", "length"}, "hypotheses were meant to end both ways"


def test_scores_are_best_first_and_n_returns_the_best_n(eos_models):
    # No prefix caching: the second call would prefill only the prompt's last token over the cached
    # blocks, whose attention (PyTorch's SDPA here) may round the last bit of a logit differently
    # from the whole prompt's (1e-7 apart in float32, with either product kernel); this test is about
    # which beams n returns, and compares their scores exactly.
    engine = engine_for(eos_models["llama"], enable_prefix_caching=False)
    four = engine.generate([PROMPT], beam_params(4, 10, n=4))
    assert [c.index for c in four] == [0, 1, 2, 3]
    assert [c.score for c in four] == sorted((c.score for c in four), reverse=True)
    two = engine.generate([PROMPT], beam_params(4, 10, n=2))
    assert [(c.token_ids, c.score) for c in two] == [(c.token_ids, c.score) for c in four[:2]]


def test_a_beam_ends_at_max_model_len_as_transformers_at_max_length(eos_models):
    folder = eos_models["qwen2"]
    engine = engine_for(folder, max_model_len=len(PROMPT) + 6)
    ours = engine.generate([PROMPT], beam_params(3, 50))
    assert all(c.completion_tokens <= 6 for c in ours)
    assert_same_beams(ours, transformers_beams(folder, PROMPT, engine.stop_token_ids, 3, 6, 1.0, False))


def test_ignore_eos_beams_run_to_max_tokens(eos_models):
    engine = engine_for(eos_models["llama"])
    params = SamplingParams(temperature=0, max_tokens=8, beam_width=3, n=3, ignore_eos=True)
    ours = engine.generate([PROMPT], params)
    assert [c.completion_tokens for c in ours] == [8, 8, 8] and {c.finish_reason for c in ours} == {"length"}
    theirs = transformers_beams(eos_models["llama"], PROMPT, frozenset(), 3, 8, 1.0, False)
    assert_same_beams(ours, theirs)


@pytest.mark.slow
def test_smollm2_beams_equal_transformers(smollm2_dir, smollm2_hf_dir):
    engine = engine_for(smollm2_dir, block_size=16, num_blocks=128)
    prompt = engine.encode([{"role": "user", "content": "Name three colours of the rainbow."}])
    for length_penalty, early_stopping in [(1.0, False), (0.6, True)]:
        ours = engine.generate([prompt], beam_params(3, 16, length_penalty, early_stopping))
        theirs = transformers_beams(smollm2_hf_dir, prompt, engine.stop_token_ids, 3, 16, length_penalty, early_stopping)
        assert_same_beams(ours, theirs)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="triton needs a GPU or TRITON_INTERPRET=1 (conftest sets it on CPU)")
def test_triton_backend_beams_equal_the_torch_backends(eos_models):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = eos_models["llama"]
    params = beam_params(3, 4)
    reference = engine_for(folder).generate([PROMPT], params)
    engine = Engine(config=EngineConfig(dtype="float32", device=device, attention="triton", block_size=4,
                                        num_blocks=64, disk_cache=False),
                    loaded=load_model(folder, "float32", device, max_positions=512))
    beams = engine.generate([PROMPT], params)
    assert [c.token_ids for c in beams] == [c.token_ids for c in reference]
    assert [c.score for c in beams] == pytest.approx([c.score for c in reference], abs=SCORE_ATOL)
    assert engine.stats().cow_block_copies > 0  # 13 prompt tokens: the partial last block was copied
