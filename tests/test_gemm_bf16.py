"""The packed bf16 GEMM (pagecli/native/gemm_bf16.cpp) against float32 math on the same bf16 values.

Each level this CPU runs is checked: where the level has AVX512-BF16 the kernel must match the
reference for any rows, widths and depths (odd ones included), pack the weights exactly, and give
every output row the same bits whatever the thread count or the batch the row came in; where it has
not, both functions must refuse with an error that says so.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagecli import native
from pagecli.native import isa

if not native.enabled():
    pytest.skip("PAGECLI_NATIVE=0 turns the compiled kernels off", allow_module_level=True)


COMPILED_LEVELS = [level for level in isa.machine_levels(native.cpu_flags()) if level != "torch"]
ROWS = (1, 2, 3, 5, 8, 13, 16, 31, 64, 130)
PANEL_COLUMNS = 48  # output columns per packed panel (gemm_bf16.cpp)


@pytest.fixture(scope="module", params=COMPILED_LEVELS)
def ops(request):
    """The kernels of each level that has the packed GEMM (levels without it: test_*_refuse_*)."""
    module = native.cpu_ops_for(request.param)
    if not module.has_packed_linear():
        pytest.skip(f"the {request.param} build has no AVX512-BF16, so no packed GEMM")
    return module


def product_case(rows, in_features, out_features, bias, seed=0):
    gen = torch.Generator().manual_seed(seed + rows * 1000 + in_features * 7 + out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()  # [M, K]
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()  # [N, K]
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None  # [N]
    return x, w, b


@pytest.mark.parametrize("in_features", [32, 64, 576, 1536, 100])
@pytest.mark.parametrize("out_features", [16, 48, 576, 960, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float32_math_for_any_rows(ops, in_features, out_features, bias):
    _, w, b = product_case(1, in_features, out_features, bias)
    packed = ops.pack_bf16_weights(w)
    for rows in ROWS:
        x, _, _ = product_case(rows, in_features, out_features, bias, seed=1)
        got = ops.linear_bf16_packed(x, packed, b, out_features, in_features)
        expected = x.float() @ w.float().T + (b.float() if bias else 0)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        torch.testing.assert_close(got.float(), expected, atol=1e-2 * math.sqrt(in_features), rtol=1e-2,
                                   msg=lambda m, rows=rows: f"{rows} rows: {m}")


def test_pack_is_exact_in_the_documented_layout(ops):
    out_features, in_features = 1000, 101  # neither a whole number of panels nor of k pairs
    _, w, _ = product_case(1, in_features, out_features, False)
    packed = ops.pack_bf16_weights(w)
    panels, k_pairs = math.ceil(out_features / PANEL_COLUMNS), math.ceil(in_features / 2)
    assert packed.dtype == torch.bfloat16 and packed.shape == (panels, k_pairs, PANEL_COLUMNS, 2)
    # packed[p, j, c, h] = w[48 p + c, 2 j + h]: back to [padded N, padded K]
    unpacked = packed.permute(0, 2, 1, 3).reshape(panels * PANEL_COLUMNS, k_pairs * 2)
    assert torch.equal(unpacked[:out_features, :in_features], w)
    assert not unpacked[out_features:].any() and not unpacked[:, in_features:].any()


@pytest.mark.parametrize(("in_features", "out_features"), [(100, 1000), (576, 960), (33, 16)])
def test_identity_rows_give_the_weight_columns_exactly(ops, in_features, out_features):
    _, w, _ = product_case(1, in_features, out_features, False)
    eye = torch.eye(in_features, dtype=torch.bfloat16)  # row m picks column m of w^T: one product, exact
    got = ops.linear_bf16_packed(eye, ops.pack_bf16_weights(w), None, out_features, in_features)
    assert torch.equal(got, w.T)


@pytest.mark.parametrize("rows", [1, 5, 64, 130])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1000), (100, 16)])
def test_results_do_not_depend_on_the_thread_count(ops, rows, in_features, out_features):
    x, w, b = product_case(rows, in_features, out_features, True)
    packed = ops.pack_bf16_weights(w)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(ops.linear_bf16_packed(x, packed, b, out_features, in_features))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (100, 1000), (64, 16)])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(ops, in_features, out_features):
    """Batched greedy decoding must pick the tokens a lone sequence would: a row's sum order may not
    depend on how many rows came with it or where it sits among them."""
    x, w, b = product_case(130, in_features, out_features, True)
    packed = ops.pack_bf16_weights(w)
    batch = ops.linear_bf16_packed(x, packed, b, out_features, in_features)
    for m in (0, 5, 63, 64, 129):
        alone = ops.linear_bf16_packed(x[m : m + 1], packed, b, out_features, in_features)
        assert torch.equal(alone, batch[m : m + 1]), f"row {m}"
    for start, stop in ((0, 64), (3, 16), (7, 10), (60, 130)):
        part = ops.linear_bf16_packed(x[start:stop], packed, b, out_features, in_features)
        assert torch.equal(part, batch[start:stop]), f"rows {start}:{stop}"


def test_takes_a_strided_view_of_x(ops):
    x, w, b = product_case(9, 576, 96, True)
    wide = torch.cat([x, x], dim=1)  # x as the left half of a wider tensor: rows 1,152 apart
    packed = ops.pack_bf16_weights(w)
    assert torch.equal(ops.linear_bf16_packed(wide[:, :576], packed, b, 96, 576),
                       ops.linear_bf16_packed(x, packed, b, 96, 576))


def test_packed_linear_refuses_inputs_that_do_not_fit_the_pack(ops):
    x, w, b = product_case(3, 64, 96, True)
    packed = ops.pack_bf16_weights(w)
    with pytest.raises(RuntimeError, match="pack_bf16_weights of a"):
        ops.linear_bf16_packed(x, packed, b, 97, 64)
    with pytest.raises(RuntimeError, match="K = 66"):
        ops.linear_bf16_packed(x, packed, b, 96, 66)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.linear_bf16_packed(x.float(), packed, b, 96, 64)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_bf16_packed(x, packed, b[:-1], 96, 64)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        ops.pack_bf16_weights(w.T)


@pytest.mark.parametrize("level", COMPILED_LEVELS)
def test_levels_without_avx512_bf16_refuse_with_a_clear_error(level):
    module = native.cpu_ops_for(level)
    if module.has_packed_linear():
        pytest.skip(f"the {level} build has the packed GEMM")
    x, w, _ = product_case(2, 64, 48, False)
    with pytest.raises(RuntimeError, match="needs AVX512-BF16"):
        module.pack_bf16_weights(w)
    with pytest.raises(RuntimeError, match="needs AVX512-BF16"):
        module.linear_bf16_packed(x, torch.zeros(1, 32, PANEL_COLUMNS, 2, dtype=torch.bfloat16), None, 48, 64)


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (101, 1000), (33, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_gives_linear_bf16_packeds_bits_for_any_leading_shape(ops, in_features, out_features, bias):
    x, w, b = product_case(13, in_features, out_features, bias)
    layer = ops.PackedLinear(w, b)
    assert (layer.out_features, layer.in_features) == (out_features, in_features)
    assert torch.equal(layer.panels, ops.pack_bf16_weights(w))
    expected = ops.linear_bf16_packed(x, ops.pack_bf16_weights(w), b, out_features, in_features)
    assert torch.equal(layer.forward(x), expected)
    assert torch.equal(layer.forward(x[:12].view(3, 4, in_features)), expected[:12].view(3, 4, out_features))
    with pytest.raises(RuntimeError, match=f"x \\[..., {in_features}\\]"):
        layer.forward(torch.zeros(2, in_features + 1, dtype=torch.bfloat16))


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1000), (101, 49), (1, 3)])
def test_rows_read_back_from_the_panels_are_the_weight_rows_exactly(ops, in_features, out_features):
    """A tied embedding table is kept only packed: the lookup must give nn.Embedding's values."""
    _, w, _ = product_case(1, in_features, out_features, False)
    layer = ops.PackedLinear(w, None)
    ids = torch.tensor([[0, out_features - 1, 47 % out_features], [out_features // 2, 0, 0]])
    assert torch.equal(layer.rows(ids), torch.nn.functional.embedding(ids, w))
    assert torch.equal(layer.rows(torch.arange(out_features)), w)
    assert torch.equal(layer.rows(torch.arange(out_features, dtype=torch.int32)), w)
    with pytest.raises(IndexError, match="out of range"):
        layer.rows(torch.tensor([out_features]))
    with pytest.raises(IndexError, match="out of range"):
        layer.rows(torch.tensor([-1]))
