"""4-bit weights (--quantize int4): groups of 32 along K with an fp16 scale and minimum each, run by
pagecli.native's int4 kernels (AVX512-VNNI: activations rounded to int8 per 64-block, nibbles
multiplied with vpdpbusd; AVX2: activations rounded to int16, vpmaddwd) or the PyTorch reference, at
every level this machine builds.

Tolerances: each kernel is held to its own arithmetic in PyTorch (int4_blocks_reference with its
activations' levels) to fp32 rounding, and to float32 math within what rounding its activations can
move each output (test_quant_int8.activation_rounding_bound).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagecli import native
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.layers import Linear
from pagecli.models.quantize import activation_levels
from pagecli.models.quantize_int4 import (
    GROUP, Int4Reference, dequantize_int4, int4_blocks_reference, int4_product, pack_nibbles, quantize_int4,
    unpack_nibbles,
)
from pagecli.native import isa
from test_quant_int8 import KERNELS, assert_within_activation_rounding, check_quantized_product
from test_quant_invariance import PROMPTS, quantized_engine

COMPILED_LEVELS = [level for level in isa.machine_levels(native.cpu_flags()) if level != "torch"]
ROWS = (1, 2, 3, 5, 8, 9, 13, 130)
# K: under one group, group tails (33, 100), odd, exact groups; N: panel tails.
SHAPES = [(33, 16), (100, 49), (576, 1000), (1, 3), (64, 48), (95, 97)]


@pytest.fixture(scope="module", params=COMPILED_LEVELS)
def ops(request):
    if not native.enabled():
        pytest.skip("PAGECLI_NATIVE=0 turns the compiled kernels off")
    module = native.cpu_ops_for(request.param)
    if not module.int4_linear_kind():
        pytest.skip(f"the {request.param} build has no int4 kernel")
    return module


def int4_weights(in_features, out_features, bias, seed=0):
    gen = torch.Generator().manual_seed(seed + in_features * 7 + out_features)
    w = torch.randn(out_features, in_features, generator=gen)  # [N, K]
    w[min(3, out_features - 1)] = 0.5  # a flat channel: every group's scale is zero
    b = torch.randn(out_features, generator=gen) if bias else None  # [N]
    return (*quantize_int4(w), b), w


def activations(rows, in_features, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed + rows)
    return torch.randn(rows, in_features, generator=gen).to(dtype)  # [M, K]


def test_quantizing_rounds_each_weight_to_within_half_its_groups_step():
    w = torch.randn(37, 101, generator=torch.Generator().manual_seed(1))  # K = 3 groups + a tail of 5
    w[5] = 2.0
    q, scale, minimum = quantize_int4(w)
    assert q.dtype == torch.uint8 and q.shape == w.shape and q.max() <= 15
    assert scale.dtype == minimum.dtype == torch.float16 and scale.shape == (37, math.ceil(101 / GROUP))
    step = scale.float().repeat_interleave(GROUP, dim=1)[:, :101]
    assert ((dequantize_int4(q, scale, minimum) - w).abs() <= step / 2 + 2e-3 * w.abs() + 1e-6).all()
    assert not q[5].any() and torch.equal(dequantize_int4(q, scale, minimum)[5], w[5])


def int4_by_definition(weight):
    """quantize_int4 as first written: the tail group padded with NaN, left out of its min and max."""
    w = weight.float()
    n, k = w.shape
    groups = -(-k // 32)
    padded = torch.nn.functional.pad(w, (0, groups * 32 - k), value=float("nan")).view(n, groups, 32)
    low = torch.where(padded.isnan(), torch.inf, padded).amin(dim=2)
    high = torch.where(padded.isnan(), -torch.inf, padded).amax(dim=2)
    minimum = low.half()
    scale = ((high - minimum.float()) / 15).half()
    step = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = torch.round((padded - minimum.float()[..., None]) / step[..., None]).clamp_(0, 15)
    q = torch.nan_to_num(q, nan=0.0).view(n, groups * 32)[:, :k].to(torch.uint8).contiguous()
    return q, scale, minimum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [32, 100, 1, 33, 128])
def test_quantizing_gives_the_definitions_bits_and_leaves_the_weight_alone(dtype, in_features):
    """The load's in-place, one-pass quantizer against the plain formula: same q, scales and minimums,
    a tail group of 1 to 31 weights too."""
    w = (torch.randn(29, in_features, generator=torch.Generator().manual_seed(3)) * 0.02).to(dtype)
    w[4] = 0.01  # a flat row: every group's step is 0
    before = w.clone()
    got, expected = quantize_int4(w), int4_by_definition(w)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert torch.equal(w, before)


def test_nibble_packing_round_trips_odd_widths():
    q = torch.randint(0, 16, (5, 33), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(q), 33), q)


# K = 8200: 130 rows span five of the VNNI products' row chunks (act_quant.h's product_units).
@pytest.mark.parametrize(("in_features", "out_features"), [*SHAPES, (8200, 100)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("kind", "levels", "int16"), KERNELS)
def test_each_int4_kernel_is_its_reference_and_within_the_rounding_of_float_math(ops, in_features, out_features,
                                                                                bias, kind, levels, int16):
    if kind == "avx512_vnni" and ops.int4_linear_kind() != kind:
        pytest.skip("this build has no AVX512-VNNI int4 kernel")
    if int16 and ops.int4_linear_kind() == "avx512_vnni":  # float32 models' int16 on the VNNI panels
        kind, levels = "avx512_vnni_i16", activation_levels("avx512_vnni_i16")
    (q, scale, minimum, b), _ = int4_weights(in_features, out_features, bias)
    layer = ops.PackedLinearInt4(q, scale, minimum, b, int16_activations=int16)
    assert layer.kind == kind
    weights = dequantize_int4(q, scale, minimum)  # [N, K] float32
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows in ROWS:
            x = activations(rows, in_features, dtype)
            x[0, : min(5, in_features)] = 0  # a block partly (or, at K = 1, wholly) zero
            got = layer.forward(x)
            assert got.dtype == dtype and got.shape == (rows, out_features)
            check_quantized_product(got, x, int4_blocks_reference(x, q, scale, minimum, b, levels), weights, b,
                                    levels, f"{dtype}, {rows} rows")


def test_the_torch_reference_is_float32_math_on_the_dequantized_weights():
    (q, scale, minimum, b), _ = int4_weights(100, 49, True)
    x = activations(7, 100, torch.float32)
    expected = x @ dequantize_int4(q, scale, minimum).T + b
    torch.testing.assert_close(Int4Reference(q, scale, minimum, b).forward(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (101, 1000), (8200, 100)])
@pytest.mark.parametrize("int16", [False, True])
def test_an_int4_row_gets_the_same_bits_alone_and_in_any_batch(ops, in_features, out_features, int16):
    (q, scale, minimum, b), _ = int4_weights(in_features, out_features, True)
    layer = ops.PackedLinearInt4(q, scale, minimum, b, int16_activations=int16)
    x = activations(130, in_features, torch.bfloat16)
    batch = layer.forward(x)
    for m in (0, 5, 63, 129):
        assert torch.equal(layer.forward(x[m : m + 1]), batch[m : m + 1]), f"row {m}"
    for start, stop in ((0, 64), (3, 16), (60, 130)):
        assert torch.equal(layer.forward(x[start:stop]), batch[start:stop]), f"rows {start}:{stop}"
    assert torch.equal(layer.forward(x[:12].view(3, 4, in_features)), batch[:12].view(3, 4, out_features))


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 3072), (1536, 576), (101, 40)])
def test_each_row_of_a_few_row_int4_product_equals_that_row_alone(ops, in_features, out_features):
    # the rows of a speculative checking step (1 + K drafts, K up to 8), on float32 rows as float32 models
    # run them: every register tile shape (1-4 rows, one or two panels, and their remainders)
    (q, scale, minimum, b), _ = int4_weights(in_features, out_features, True)
    layer = ops.PackedLinearInt4(q, scale, minimum, b, int16_activations=True)
    x = activations(9, in_features, torch.float32)
    alone = torch.cat([layer.forward(x[m : m + 1]) for m in range(9)])
    for rows in range(1, 10):
        assert torch.equal(layer.forward(x[:rows]), alone[:rows]), f"{rows} rows"
        assert torch.equal(layer.forward(x[9 - rows :]), alone[9 - rows :]), f"last {rows} rows"


def test_the_int4_kernel_refuses_what_it_cannot_take(ops):
    (q, scale, minimum, b), _ = int4_weights(64, 48, True)
    with pytest.raises(RuntimeError, match="uint8 \\[N, K\\]"):
        ops.PackedLinearInt4(q.float(), scale, minimum, b)
    with pytest.raises(RuntimeError, match="fp16 \\[N, ceil\\(K / 32\\)\\] = \\[48, 2\\]"):
        ops.PackedLinearInt4(q, scale[:, :1].contiguous(), minimum, b)
    with pytest.raises(RuntimeError, match="4-bit values"):
        ops.PackedLinearInt4(q + 16, scale, minimum, b)
    with pytest.raises(RuntimeError, match="x \\[..., 64\\]"):
        ops.PackedLinearInt4(q, scale, minimum, b).forward(torch.zeros(2, 65, dtype=torch.bfloat16))


def int4_engine(folder, **config) -> Engine:
    return quantized_engine(folder, "int4", **config)


@pytest.mark.parametrize("level", ["torch", *COMPILED_LEVELS])
def test_every_level_runs_an_int4_model_on_its_own_products(tiny_model_factory, monkeypatch, level):
    """PAGECLI_CPU_ISA=torch runs the PyTorch reference; each compiled level its own kernel. The
    greedy tokens of a float32 model on the reference and of a bf16 model on a kernel may part ways
    (bf16 activations), so only each prompt's first token is compared, and one of five may differ."""
    folder = tiny_model_factory("llama")

    def first_tokens(level_name, dtype):
        monkeypatch.setenv("PAGECLI_CPU_ISA", level_name)
        monkeypatch.setattr(native, "_state", {})
        with int4_engine(folder, dtype=dtype) as engine:
            products = [m.packed for m in engine.loaded.model.model.layers.modules() if isinstance(m, Linear)]
            on_reference = [isinstance(p, Int4Reference) for p in products]
            outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        return on_reference, [o.token_ids[0] for o in outs]

    reference_flags, reference = first_tokens("torch", "float32")
    assert all(reference_flags)
    if level == "torch":
        return
    flags, got = first_tokens(level, "bfloat16")
    assert not any(flags), f"the {level} level left products on the PyTorch reference"
    assert sum(a == b for a, b in zip(got, reference)) >= len(PROMPTS) - 1, (got, reference)


@pytest.mark.parametrize("level", COMPILED_LEVELS)
@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_a_float32_model_rounds_activations_to_int16_and_keeps_the_references_tokens(tiny_model_factory, monkeypatch,
                                                                                      level, quantize):
    """A float32 model runs its quantized products with activations rounded to int16 (2^-16 of a block's
    largest) at every level: the AVX2 kernel, or on a VNNI build the int4 products' wide tiles, so its greedy
    tokens are the PyTorch reference's: float32 math on the same dequantized weights."""
    folder = tiny_model_factory("llama")

    def tokens(level_name):
        monkeypatch.setenv("PAGECLI_CPU_ISA", level_name)
        monkeypatch.setattr(native, "_state", {})
        with quantized_engine(folder, quantize, dtype="float32") as engine:
            products = [m.packed for m in engine.loaded.model.model.layers.modules() if isinstance(m, Linear)]
            kinds = {getattr(p, "kind", "reference") for p in products}
            outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        return kinds, [o.token_ids for o in outs]

    reference_kinds, reference = tokens("torch")
    assert reference_kinds == {"reference"}
    kinds, got = tokens(level)
    wide = quantize == "int4" and native.cpu_ops().int4_linear_kind() == "avx512_vnni"
    assert kinds == {"avx512_vnni_i16" if wide else "avx2"}, f"the {level} level's float32 products ran on {kinds}"
    assert got == reference


def test_the_wide_tiles_keep_their_prefixes_apart_from_the_avx2_kernels(tiny_model_factory, monkeypatch):
    """A float32 model's 4-bit products round activations to 32639 levels on a VNNI build and to 32767 at the
    avx2 level: KV bytes a little apart, so the disk store's fingerprints differ; a bf16 model's are the same."""
    ops = native.cpu_ops()
    if ops is None or ops.int4_linear_kind() != "avx512_vnni" or "avx2" not in COMPILED_LEVELS:
        pytest.skip("the wide tiles need an AVX512-VNNI build beside the avx2 level")
    folder = tiny_model_factory("llama")

    def prints(level_name):
        monkeypatch.setenv("PAGECLI_CPU_ISA", level_name)
        monkeypatch.setattr(native, "_state", {})
        found = {}
        for dtype in ("float32", "bfloat16"):
            with quantized_engine(folder, "int4", dtype=dtype) as engine:
                found[dtype] = engine.fingerprint
        return found

    vnni, avx2 = prints(COMPILED_LEVELS[0]), prints("avx2")
    assert vnni["float32"] != avx2["float32"] and "a32639" in vnni["float32"]
    assert vnni["bfloat16"] == avx2["bfloat16"] and "a32639" not in vnni["bfloat16"]


def test_int4_weights_count_as_their_packed_bytes(tiny_model_factory):
    folder = tiny_model_factory("llama")
    sizes = {}
    for quantize in ("none", "int8", "int4"):
        with Engine(str(folder), EngineConfig(dtype="bfloat16", disk_cache=False, quantize=quantize)) as engine:
            sizes[quantize] = engine.weights_bytes
    assert sizes["int4"] < sizes["int8"] < sizes["none"]


def test_quantized_weights_do_not_share_the_bf16_prefix_fingerprint(tiny_model_factory):
    folder = tiny_model_factory("llama")
    prints = set()
    for quantize in ("none", "int8", "int4"):
        with Engine(str(folder), EngineConfig(dtype="bfloat16", disk_cache=False, quantize=quantize)) as engine:
            prints.add(engine.fingerprint)
    assert len(prints) == 3


def test_a_layer_on_the_torch_reference_matches_the_kernel_layer(ops):
    (q, scale, minimum, b), _ = int4_weights(96, 100, True)
    lin = Linear(96, 100, bias=True)
    lin.weight = torch.nn.Parameter(torch.zeros(100, 96), requires_grad=False)
    lin.bias = torch.nn.Parameter(b, requires_grad=False)
    lin.use_product(*int4_product(q, scale, minimum, b, ops))
    x = activations(3, 96, torch.bfloat16)
    levels = activation_levels(lin.packed.kind)  # the activations' rounding
    assert_within_activation_rounding(lin(x), x, dequantize_int4(q, scale, minimum), b, levels, "the layer")
    assert lin.weight is None
