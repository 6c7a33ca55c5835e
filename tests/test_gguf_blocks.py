"""GGUF Q4_0 / Q4_1 / Q8_0 tensors read as they are (--quantize gguf): the blocks in pagecli's layouts
stand for exactly the floats the gguf package dequantizes them to, and the embedded model runs on its
own Q4_1 weights."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from pagecli import native
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.errors import ModelError, PagecliError
from pagecli.models import gguf_blocks, gguf_files, weight_plan
from pagecli.models.gguf_blocks import Int4Parts, Q8Parts, dequantize_parts, tensor_parts
from pagecli.models.layers import Linear
from pagecli.models.quantize import INT16_LEVELS, activation_levels, round_activations
from pagecli.models.source import default_model_gguf
from pagecli.native import isa
from test_quant_int8 import assert_within_activation_rounding

COMPILED_LEVELS = [level for level in isa.machine_levels(native.cpu_flags()) if level != "torch"]


def fake_tensor(kind: str, rows: int, cols: int, seed: int = 0):
    """What GGUFReader gives for a [rows, cols] matrix quantized to `kind` by the gguf package."""
    gen = np.random.default_rng(seed)
    weight = (gen.standard_normal((rows, cols)) * gen.uniform(0.01, 3.0, (rows, 1))).astype(np.float32)
    weight[1, :32] = 0.25  # a flat block
    kind_enum = GGMLQuantizationType[kind]
    return SimpleNamespace(tensor_type=kind_enum, shape=np.array([cols, rows]), data=quants.quantize(weight, kind_enum))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_read_by_pagecli_dequantize_bit_for_bit_as_the_gguf_package(kind):
    tensor = fake_tensor(kind, 37, 160)
    parts = tensor_parts(tensor)
    assert isinstance(parts, Q8Parts if kind == "Q8_0" else Int4Parts)
    expected = quants.dequantize(tensor.data, tensor.tensor_type).reshape(37, 160)
    assert_same_floats(dequantize_parts(parts).numpy(), expected)


def assert_same_floats(got: np.ndarray, expected: np.ndarray) -> None:
    """Bit for bit, but for the sign of a zero: Q4_0's (q - 8) * d gives -0.0 where d < 0 and q = 8,
    pagecli's q * d + (-8 d) gives +0.0 (the kernels compute the latter; the two are equal floats)."""
    assert np.array_equal(got, expected)
    nonzero = expected != 0
    assert np.array_equal(got[nonzero].view(np.uint32), expected[nonzero].view(np.uint32))


def test_every_quantized_tensor_of_the_embedded_file_reads_bit_for_bit():
    reader = GGUFReader(default_model_gguf())
    read = 0
    for tensor in reader.tensors:
        parts = tensor_parts(tensor)
        if parts is None:
            assert tensor.tensor_type.name not in gguf_blocks.AS_IS_TYPES
            continue
        expected = quants.dequantize(tensor.data, tensor.tensor_type).reshape(parts.q.shape)
        assert np.array_equal(dequantize_parts(parts).numpy().view(np.uint32), expected.view(np.uint32)), tensor.name
        read += 1
    assert read == 211  # 30 layers x 7 matrices (Q4_1) and the embedding table (Q8_0)


def test_other_types_are_left_to_the_float_conversion():
    tensor = SimpleNamespace(tensor_type=GGMLQuantizationType.F16, shape=np.array([32, 4]), data=np.zeros((4, 32)))
    assert tensor_parts(tensor) is None
    assert gguf_blocks.stacked_parts([fake_tensor("Q4_0", 4, 32), tensor]) is None


def test_a_fused_products_tensors_decode_into_one_stack_with_the_qk_row_order_undone():
    from pagecli.models.gguf_convert import unpermute_rotary_rows

    q, k, v = fake_tensor("Q4_1", 64, 96, seed=1), fake_tensor("Q4_1", 32, 96, seed=2), fake_tensor("Q4_0", 32, 96, seed=3)
    stacked = gguf_blocks.stacked_parts([q, k, v], [4, 2, None])
    singles = [tensor_parts(q), tensor_parts(k), tensor_parts(v)]

    def rows(t, heads):
        return t if heads is None else torch.from_numpy(np.ascontiguousarray(unpermute_rotary_rows(t.numpy(), heads)))

    for field in ("q", "scale", "minimum"):
        expected = torch.cat([rows(getattr(part, field), heads) for part, heads in zip(singles, [4, 2, None])])
        assert torch.equal(getattr(stacked, field), expected), field
    assert gguf_blocks.stacked_parts([q, fake_tensor("Q8_0", 32, 96)]) is None  # 4-bit and int8: the floats
    assert gguf_blocks.stacked_parts([q, fake_tensor("Q4_1", 32, 64)]) is None  # two widths


@pytest.mark.parametrize("level", COMPILED_LEVELS)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_run_on_the_int4_kernel_as_float32_math_on_their_floats(level, kind):
    ops = native.cpu_ops_for(level)
    parts = tensor_parts(fake_tensor(kind, 100, 96, seed=3))
    layer = ops.PackedLinearInt4(parts.q, parts.scale, parts.minimum, None)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4)).bfloat16()
    levels = activation_levels(layer.kind)  # the activations' rounding
    assert_within_activation_rounding(layer.forward(x), x, dequantize_parts(parts), None, levels, kind)


def q8_0_reference(x: torch.Tensor, parts: Q8Parts) -> torch.Tensor:
    """The AVX2 int8 kernel's arithmetic on Q8_0 blocks in PyTorch (float64): x rounded to int16 per
    64-block (round_activations), each 32-block's integer sum times d and the block's fp16 scale."""
    xq, d = round_activations(x, INT16_LEVELS)  # [M, B, 64], [M, B, 1]
    n, k = parts.q.shape
    groups = parts.scale.shape[1]
    xg = xq.reshape(len(xq), -1, 32)[:, :groups]  # [M, G, 32]
    dg = d.repeat_interleave(2, dim=1)[:, :groups]  # [M, G, 1]
    wq = torch.nn.functional.pad(parts.q.double(), (0, groups * 32 - k)).view(n, groups, 32)
    return (torch.einsum("mgk,ngk->mgn", xg, wq) * dg * parts.scale.double().T[None]).sum(1).float()


@pytest.mark.parametrize("level", COMPILED_LEVELS)
@pytest.mark.parametrize(("rows", "cols"), [(100, 160), (37, 96), (5, 32)])
def test_q8_0_blocks_run_as_they_are_on_the_avx2_int8_kernel(level, rows, cols):
    """fp16 scales per 32 (the file's own Q8_0 numbers): the kernel's arithmetic to fp32 rounding, float
    math on the dequantized blocks within the int16 rounding, a row's bits the same alone."""
    ops = native.cpu_ops_for(level)
    parts = tensor_parts(fake_tensor("Q8_0", rows, cols, seed=5))
    layer = ops.PackedLinearInt8(parts.q, parts.scale, None, int16_activations=True)
    assert layer.kind == "avx2" and layer.scales.dtype == torch.float16
    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(6))
    got = layer.forward(x)
    torch.testing.assert_close(got, q8_0_reference(x, parts), rtol=1e-5, atol=1e-5 * cols ** 0.5)
    assert_within_activation_rounding(got, x, dequantize_parts(parts), None, INT16_LEVELS, "Q8_0")
    assert torch.equal(layer.forward(x[4:5]), got[4:5])
    with pytest.raises(RuntimeError, match="fp16 \\[N, ceil\\(K / 32\\)\\]"):
        ops.PackedLinearInt8(parts.q, parts.scale[:, :-1], None, int16_activations=True)


def test_the_embedded_file_says_which_path_its_weights_take():
    line = gguf_files.describe_path(default_model_gguf())
    assert line == "--quantize gguf runs Q4_1 x210 as they are"


def test_quantize_gguf_needs_a_gguf_model(tiny_model_factory):
    with pytest.raises(PagecliError, match="not loaded from a .gguf file"):
        Engine(str(tiny_model_factory("llama")), EngineConfig(dtype="bfloat16", disk_cache=False, quantize="gguf"))


AVX2_OPS = SimpleNamespace(int8_linear_kind=lambda: "avx2", int4_linear_kind=lambda: "avx2",
                           has_packed_linear=lambda: False, has_amx=lambda: False, has_bf16_weight_linear=lambda: True)


def auto_quantize(folder, dtype, ops):
    """What --quantize auto runs for this folder, dtype and kernels (the weight plan's choice)."""
    return weight_plan.plan_for_folder(folder, dtype, torch.device("cpu"), "auto", ops).quantize


def test_auto_runs_a_gguf_models_blocks_only_where_it_runs_in_float32_on_the_native_kernels(
        smollm2_dir, tiny_model_factory, monkeypatch):
    assert auto_quantize(smollm2_dir, torch.float32, AVX2_OPS) == "gguf"
    vnni = SimpleNamespace(**{**vars(AVX2_OPS), "int8_linear_kind": lambda: "avx512_vnni",
                              "int4_linear_kind": lambda: "avx512_vnni"})
    assert auto_quantize(smollm2_dir, torch.float32, vnni) == "gguf"  # float32: int16 kernels
    assert auto_quantize(smollm2_dir, torch.bfloat16, vnni) == "none"  # int8 activations: lossy
    assert auto_quantize(smollm2_dir, torch.float32, None) == "none"  # the PyTorch path
    unbuilt = SimpleNamespace(**{**vars(AVX2_OPS), "int8_linear_kind": lambda: "", "int4_linear_kind": lambda: ""})
    assert auto_quantize(smollm2_dir, torch.float32, unbuilt) == "none"
    assert auto_quantize(tiny_model_factory("llama"), torch.float32, AVX2_OPS) == "none"  # not a GGUF
    monkeypatch.setattr(gguf_files, "tensor_types", lambda path, folder=None: {"F16": 7, "F32": 2})
    assert auto_quantize(smollm2_dir, torch.float32, AVX2_OPS) == "none"  # no blocks to run

    def unreadable(path, folder=None):
        raise ModelError("not a GGUF file")

    monkeypatch.setattr(gguf_files, "tensor_types", unreadable)
    assert auto_quantize(smollm2_dir, torch.float32, AVX2_OPS) == "none"  # the floats still load


def test_the_default_engine_runs_the_embedded_models_blocks_in_float32(smollm2_dir):
    """--quantize auto (the default) as the engine resolves it: the file's blocks in a float32 run with the
    native kernels, another KV fingerprint than the floats' (another model's numbers), the floats in bf16."""
    said = []
    config = EngineConfig(dtype="float32", disk_cache=False)
    with Engine(str(smollm2_dir), config, progress=said.append) as engine:
        native_ops = native.cpu_ops() if native.enabled() else None
        assert engine.quantize == ("gguf" if native_ops is not None else "none")
        auto_fingerprint = engine.fingerprint
        if engine.quantize == "gguf":
            assert any("--quantize auto" in message for message in said)
            assert type(engine.loaded.model.output_packed).__name__ == "PackedLinearInt8"
    with Engine(str(smollm2_dir), EngineConfig(dtype="float32", disk_cache=False, quantize="none")) as engine:
        assert engine.quantize == "none"
        assert (engine.fingerprint != auto_fingerprint) == (native_ops is not None)
    with Engine(str(smollm2_dir), EngineConfig(dtype="bfloat16", disk_cache=False)) as engine:
        assert engine.quantize == "none"


@pytest.mark.slow
def test_the_embedded_model_runs_on_its_own_q4_1_weights(smollm2_dir):
    """Greedy output, 24 tokens, on test_smollm2_end_to_end's 9 requests, against the float32 path (the
    converted folder: the same numbers, dequantized). A float32 model rounds its activations to int16
    per 64-block (the AVX2 kernel at every level) or keeps them float (the PyTorch reference): the
    tokens equal the float32 path's on all 9 (measured 2026-11-25 on the reference, 2026-11-26 on the
    float-activation AVX2 kernel this replaced at the avx512 level, Zen 4, 2026-11-27 on the int16
    one at the avx2 level, Zen 3, with the output layer on the file's Q8_0 blocks too; bf16 there:
    4 of 9, [24, 0, 0, 24, 6, 17, 6, 24, 24]).
    A bf16 model on the AVX512-VNNI kernel rounds activations to int8 per 64-block: measured
    2026-11-26 (Zen 4) 2 of 9 identical ([0, 2, 0, 24, 5, 4, 0, 1, 24]), where the bf16 float path
    itself gives 4 of 9 ([0, 0, 0, 24, 24, 17, 6, 24, 24]). The bounds keep a broken kernel (which
    parts at once everywhere) from passing, with room for other CPUs' float kernels."""
    from test_smollm2_end_to_end import REQUESTS

    def outputs(quantize, dtype):
        with Engine(str(smollm2_dir), EngineConfig(dtype=dtype, disk_cache=False, quantize=quantize)) as engine:
            if quantize == "gguf":
                products = [m.packed for m in engine.loaded.model.model.layers.modules() if isinstance(m, Linear)]
                assert len(products) == 30 * 4 and all(p is not None for p in products)
                assert {type(p).__name__ for p in products} <= {"PackedLinearInt4", "Int4Reference"}  # all Q4_1
                output = engine.loaded.model.output_packed
                if dtype == "float32" and native.enabled():  # the tied Q8_0 table's own blocks
                    assert type(output).__name__ == "PackedLinearInt8" and output.scales.dtype == torch.float16
            prompts = [engine.encode_chat(r["messages"]) if "messages" in r else engine.encode(r["prompt"])
                       for r in REQUESTS]
            sampling = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            return [o.token_ids for o in engine.generate(prompts, sampling)]

    float_path = outputs("none", "float32")
    agreeing = {}
    for dtype in ("float32", "bfloat16"):
        got = outputs("gguf", dtype)
        agreeing[dtype] = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 24) for x, y in zip(float_path, got)]
    print("Q4_1 blocks vs the float32 path, first differing token per request:", agreeing)
    # 9 measured; 8 leaves room for a CPU whose float kernel sums in another order
    assert sum(n == 24 for n in agreeing["float32"]) >= 8, agreeing
    ops = native.cpu_ops() if native.enabled() else None
    if ops is not None and ops.int4_linear_kind() == "avx512_vnni":
        assert sum(n == 24 for n in agreeing["bfloat16"]) >= 1 and sum(agreeing["bfloat16"]) >= 30, agreeing
    else:
        assert sum(n == 24 for n in agreeing["bfloat16"]) >= 4, agreeing


def test_every_shipped_profile_leaves_quantize_to_auto():
    """The CLI reads profiles/default.toml when no profile is named: a `quantize = "none"` there kept
    every run on the converted floats whatever EngineConfig's default said."""
    from pagecli.config.profiles import available_profiles, load_profile

    profiles = available_profiles()
    assert {p.stem for p in profiles} >= {"default", "cpu-small"}
    for path in profiles:
        assert load_profile(str(path)).engine_config().quantize == "auto", path.name
    assert load_profile().engine_config().quantize == "auto"


def test_a_tied_table_on_q8_0_blocks_looks_its_rows_up_there_exactly(smollm2_dir, smollm2_hf_dir):
    """The embedded model's tied table is Q8_0 in its file: where the output layer runs those blocks as they
    lie, the lookup reads rows from them (weight_forms.Q8Rows) and no float table is kept; every row equals
    the converted folder's float32 row (gguf's dequantization) bit for bit."""
    from safetensors import safe_open

    with Engine(str(smollm2_dir), EngineConfig(dtype="float32", disk_cache=False)) as engine:
        embed = engine.loaded.model.model.embed_tokens
        if not engine.plan.q8_0_as_is:
            pytest.skip("Q8_0 blocks do not run as they lie here")
        assert embed.weight is None and type(embed.packed).__name__ == "Q8Rows"
        ids = torch.arange(engine.loaded.spec.vocab_size).view(-1, 64)  # every row, in a 2-D batch
        rows = embed(ids).view(-1, engine.loaded.spec.hidden_size)
    file = next(smollm2_hf_dir.glob("*.safetensors"))
    with safe_open(str(file), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight").float()
    assert torch.equal(rows, table)
