"""A bf16 model on the packed GEMM (the weight plan's bf16-panels form): every product, the output
layer's and the C++ decode step's included, runs on pagecli.native's packed panels; the row-layout
weights are gone; greedy output is the same whatever the batching, and PAGECLI_PACKED_GEMM=0 turns
it off."""

from __future__ import annotations

import pytest
import torch

from pagecli import native
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models import weight_plan
from pagecli.models.layers import Embedding, Linear

if not native.enabled() or native.cpu_ops() is None or not weight_plan.bf16_panels_offered(native.cpu_ops()):
    pytest.skip("the packed GEMM is not what this machine's level runs (no AVX512-BF16, AMX, or turned off)",
                allow_module_level=True)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 5, 9, 13, 17], [3, 4], [7] * 23, [11, 30, 2, 8, 8, 8, 40, 41, 42]]


def engine_for(folder, **config) -> Engine:
    return Engine(str(folder), EngineConfig(**{"dtype": "bfloat16", "disk_cache": False, "block_size": 4, **config}))


@pytest.mark.parametrize("arch", ["llama", "llama3"])  # separate output layer; tied embeddings
def test_a_packed_model_keeps_only_the_packed_weights(tiny_model_factory, arch):
    with engine_for(tiny_model_factory(arch)) as engine:
        model = engine.loaded.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and all(m.weight is None and m.packed is not None for m in linears)
        assert model.output_packed is not None
        embed = model.model.embed_tokens
        if model.spec.tie_word_embeddings:
            assert embed.weight is None and embed.packed is model.output_packed
        else:
            assert isinstance(embed, Embedding) and embed.weight is not None
        packed_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert engine.weights_bytes == packed_bytes  # counted once, in the layout that is held


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3"])
def test_packed_greedy_output_does_not_depend_on_batching_or_chunking(tiny_model_factory, arch):
    # head size 32, so prompts go through pagecli's attention kernels a row per token (at the tiny
    # models' default of 16 they take PyTorch's SDPA, whose bits depend on the chunk)
    folder = tiny_model_factory(arch, head_dim=32)
    with engine_for(folder) as engine:
        alone = [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
        together = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    with engine_for(folder, max_num_batched_tokens=3) as engine:
        chunked = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert together == alone and chunked == alone


def test_packed_logits_equal_the_row_layout_products_on_the_same_rows(tiny_model_factory, monkeypatch):
    """The packed products sum in another order than the older kernels, so the bits may differ, but
    only by rounding; PAGECLI_PACKED_GEMM=0 gives the row-layout model back."""
    folder = tiny_model_factory("llama3")
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with engine_for(folder) as engine:
        packed_logits = engine.loaded.model.compute_logits(hidden)
    monkeypatch.setenv(weight_plan.PACKED_GEMM_VAR, "0")
    with engine_for(folder) as engine:
        model = engine.loaded.model
        assert model.output_packed is None and model.output_weight is not None
        row_logits = model.compute_logits(hidden)
    torch.testing.assert_close(packed_logits.float(), row_logits.float(), atol=0.05, rtol=0.02)
