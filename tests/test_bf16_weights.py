"""Float32 models run their products on 16-column panels on every compiled level (pagecli.native's
F32PanelLinear), weights that hold only bfloat16 values (converted from a bf16 checkpoint) kept in
bf16: half the bytes, the same numbers; other weights in float32.

Tolerances: each product of a float32 activation and a bf16 weight is exact in fp32, so the kernel
differs from float64 math only by fp32 rounding in its sums (within 1e-5 * sqrt(K) here, for values
of order 1), and a model's logits from transformers' float32 on the same weights by the summation
order, as test_model_parity allows (1e-4). Each output sums its products in k order in one lane
whatever the batch, so a row's bits do not depend on the rows beside it.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_probes import recorded_logits
from native_levels import ops, skip_without_native  # noqa: F401 - ops is a fixture
from pagecli import native
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models import weight_plan
from pagecli.models.layers import Linear

skip_without_native()


def bf16_valued(shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


def reference(x, w, bias=None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("n, k", [(16, 8), (33, 17), (50, 64), (200, 576)])
def test_products_equal_float64_math_and_each_row_alone(ops, rows, n, k):
    w, x = bf16_valued((n, k)), bf16_valued((rows, k), seed=1) + torch.rand(rows, k) * 1e-3  # x not bf16-valued
    bias = bf16_valued((n,), seed=2) if rows % 2 else None
    product = ops.F32PanelLinear(w, bias)
    y = product.forward(x)
    torch.testing.assert_close(y, reference(x, w, bias), atol=1e-5 * k**0.5, rtol=1e-5)
    alone = torch.cat([product.forward(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(alone, y)
    assert product.forward(x.view(1, rows, k)).shape == (1, rows, n)


def test_the_panels_hold_half_the_bytes_and_give_back_exact_rows(ops):
    w = bf16_valued((70, 48))
    product = ops.F32PanelLinear(w, None)
    assert product.panels.dtype == torch.bfloat16 and product.panels.numel() == 80 * 48  # 5 panels of 16
    ids = torch.tensor([[0, 69], [15, 16]])
    assert torch.equal(product.rows(ids), w[ids])
    assert product.out_features == 70 and product.in_features == 48


def test_weights_that_bf16_cannot_hold_keep_float32_panels(ops):
    w = bf16_valued((40, 32))
    assert ops.bf16_exact(w)
    w[3, 5] += 1e-4  # a float32 value between two bf16s
    assert not ops.bf16_exact(w)
    product = ops.F32PanelLinear(w, None)
    assert product.panels.dtype == torch.float32 and product.panels.numel() == 48 * 32
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(product.forward(x), reference(x, w), atol=1e-5 * 32**0.5, rtol=1e-5)
    assert torch.equal(torch.cat([product.forward(x[i : i + 1]) for i in range(7)]), product.forward(x))
    assert torch.equal(product.rows(torch.tensor([3, 39])), w[[3, 39]])
    with pytest.raises(RuntimeError, match="float32 x"):
        product.forward(torch.ones(2, 32, dtype=torch.bfloat16))


# ---- a model ------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 5, 9, 13, 17], [3, 4], [7] * 23, [11, 30, 2, 8, 8, 8, 40, 41, 42]]


def bf16_checkpoint(folder, dest):
    """A copy of a tiny model folder stored in bfloat16, as most published checkpoints are."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            (dest / path.name).write_bytes(path.read_bytes())
    for path in folder.glob("*.safetensors"):
        tensors = {name: t.bfloat16() if t.is_floating_point() else t for name, t in load_file(path).items()}
        save_file(tensors, dest / path.name, metadata={"format": "pt"})
    return dest


def engine_for(folder, **config) -> Engine:
    return Engine(str(folder), EngineConfig(**{"dtype": "float32", "disk_cache": False, "block_size": 4, **config}))


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])  # own output layer; tied; q/k/v biases
def test_a_bf16_checkpoint_in_float32_keeps_only_bf16_panels(tiny_model_factory, tmp_path, arch):
    folder = bf16_checkpoint(tiny_model_factory(arch), tmp_path / arch)
    with engine_for(folder) as engine:
        model = engine.loaded.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and all(m.weight is None and type(m.packed).__name__ == "F32PanelLinear" for m in linears)
        assert type(model.output_packed).__name__ == "F32PanelLinear"
        if model.spec.tie_word_embeddings:
            assert model.model.embed_tokens.weight is None
        assert model.decode_step is not None
        for m in linears:  # what the model holds (and counts) is the bf16 panels: 2 bytes a weight
            n, k = m.packed.out_features, m.packed.in_features
            assert m.packed_weight.dtype == torch.bfloat16 and m.packed_weight.numel() == -(-n // 16) * 16 * k
        assert engine.weights_bytes == sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3"])
def test_logits_and_greedy_tokens_match_transformers_on_the_same_weights(tiny_model_factory, tmp_path,
                                                                        arch):
    from transformers import AutoModelForCausalLM

    folder = bf16_checkpoint(tiny_model_factory(arch), tmp_path / arch)
    with engine_for(folder, num_blocks=128) as engine:
        assert type(engine.loaded.model.output_packed).__name__ == "F32PanelLinear"
        logits = recorded_logits(engine)
        prompt = "The quick brown fox jumps over the lazy dog. Paged attention keeps"
        [out] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        ids = engine.encode(prompt)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids + list(out.token_ids)])).logits[0]
        tokens = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             pad_token_id=0)[0][len(ids):]
    for step, got in enumerate(logits):
        diff = (got[0] - ref[len(ids) - 1 + step]).abs().max().item()
        assert diff < 1e-4, f"{arch}: step {step} logits differ by {diff}"
    assert list(out.token_ids) == tokens.tolist()


def test_greedy_output_does_not_depend_on_batching(tiny_model_factory, tmp_path):
    folder = bf16_checkpoint(tiny_model_factory("llama3", head_dim=32), tmp_path / "m")
    with engine_for(folder) as engine:
        alone = [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
        together = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert together == alone


def test_float32_weights_go_on_float32_panels(tiny_model_factory):
    with engine_for(tiny_model_factory("llama3")) as engine:  # random float32 values: not bf16
        model = engine.loaded.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(m.weight is None and m.packed_weight.dtype == torch.float32 for m in linears)
        assert model.output_packed.panels.dtype == torch.float32 and model.decode_step is not None


def test_every_level_keeps_bf16_weights_unless_turned_off(tiny_model_factory, tmp_path, monkeypatch):
    ops = native.cpu_ops()
    assert weight_plan.float_panels_offered(ops)  # every level's build has the kernel (AVX2 and FMA)
    folder = bf16_checkpoint(tiny_model_factory("llama3"), tmp_path / "m")
    with engine_for(folder) as engine:
        assert type(engine.loaded.model.output_packed).__name__ == "F32PanelLinear"
    monkeypatch.setenv(weight_plan.FLOAT_PANELS_VAR, "0")
    assert not weight_plan.float_panels_offered(ops)
    with engine_for(folder) as engine:
        assert all(m.packed is None for m in engine.loaded.model.modules() if isinstance(m, Linear))
