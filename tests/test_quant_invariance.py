"""A quantized model's greedy output does not depend on batching, prefix hits, chunked prefill or
preemption (the engine invariance suite, run with --quantize int8 and int4 on the kernels of this
machine's level): the products give a row the same bits alone or in any batch."""

from __future__ import annotations

import pytest

from pagecli import native
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.layers import Linear

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[1, 5, 9, 13, 17], [3, 4], [7] * 23, [11, 30, 2, 8, 8, 8, 40, 41, 42], list(range(3, 40))]


def _invariant_dtype() -> str:
    """bfloat16 where pagecli's own bf16 products run (AVX512-BF16 or AMX: a row's bits do not depend on its
    batch). Elsewhere (AVX2) the float layers' bf16 products are PyTorch's, which round a row differently by
    batch size, and pagecli runs float32 there: so does this test."""
    ops = native.cpu_ops() if native.enabled() else None
    return "bfloat16" if ops is not None and (ops.has_amx() or ops.has_packed_linear()) else "float32"


INVARIANT_DTYPE = _invariant_dtype()


def quantized_engine(folder, quantize: str, **config) -> Engine:
    settings = {"dtype": "bfloat16", "disk_cache": False, "block_size": 4, "quantize": quantize, **config}
    return Engine(str(folder), EngineConfig(**settings))


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, q/k/v bias, q/k norm
def test_quantized_greedy_output_does_not_depend_on_batching_chunking_preemption_or_prefix_hits(
        tiny_model_factory, arch, quantize):
    # head size 32: on AVX512-BF16, prompts then go through the decode kernel a row per token (the
    # attention that chunking cannot change); the tiny models' default of 16 takes PyTorch's SDPA,
    # whose bits for a prompt chunk depend on the chunk, so the test would hold only by luck.
    folder = tiny_model_factory(arch, head_dim=32)
    with quantized_engine(folder, quantize, dtype=INVARIANT_DTYPE) as engine:
        layers = [m for m in engine.loaded.model.model.layers.modules() if isinstance(m, Linear)]
        assert layers and all(m.weight is None and m.packed is not None for m in layers)
        alone = [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
        together = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]  # prefix hits from the runs alone
        assert engine.stats().prefix_hit_tokens > 0
    with quantized_engine(folder, quantize, dtype=INVARIANT_DTYPE, max_num_batched_tokens=3) as engine:
        chunked = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    with quantized_engine(folder, quantize, dtype=INVARIANT_DTYPE, max_num_batched_tokens=3,
                          enable_prefix_caching=False) as engine:
        chunked_uncached = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    with quantized_engine(folder, quantize, dtype=INVARIANT_DTYPE, num_blocks=14,
                          enable_prefix_caching=False) as engine:
        preempted = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
        assert engine.stats().num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    assert together == alone and chunked == alone and chunked_uncached == alone and preempted == alone
