"""pagecli's compiled CPU kernels (pagecli.native) against the PyTorch code they replace.

Each kernel is checked on the shapes the engine gives it (views into a flat batch, shuffled block
tables, block sizes 1 and 16, GQA ratios 1 to 4, head sizes with and without a specialised
version) in float32, bfloat16 and float16. The engine-level parity tests (test_model_parity.py,
test_engine_invariance.py) run with these kernels on as well.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagecli import native
from pagecli.native import isa
from pagecli.attention import AttentionMetadata
from pagecli.attention.reference import reference_paged_attention
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models import weight_plan
from pagecli.models.layers import GatedMLP, RMSNorm, RotaryEmbedding

from engine_probes import assert_one_call_equals_layer_loop
from native_levels import threads

if not native.enabled():
    pytest.skip("PAGECLI_NATIVE=0 turns the compiled kernels off", allow_module_level=True)


COMPILED_LEVELS = [level for level in isa.machine_levels(native.cpu_flags()) if level != "torch"]


@pytest.fixture(scope="module", params=COMPILED_LEVELS)
def ops(request):
    """The kernels of each instruction-set level this CPU runs (PAGECLI_CPU_ISA's choices): every test
    that takes `ops` runs once per level, against the same PyTorch reference."""
    return native.cpu_ops_for(request.param)


# (atol, rtol) against float32 math on the same stored values.
TOLERANCES = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1e-2)}


def paged_decode_case(seq_lens, *, block_size, kv_heads, group, head_dim, dtype, seed=0):
    """Random K/V in shuffled blocks, and a flat query batch whose first len(seq_lens) rows decode."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + 1  # one spare column, as a longer prefill row in the same step would add
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n] + [0] * (width - n))
        used += n
    # Two extra rows after the decodes stand for prefill tokens of the same step.
    query = torch.randn(len(seq_lens) + 2, kv_heads * group, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(2, 1, 64), (3, 3, 64), (1, 4, 80), (2, 2, 128), (2, 2, 40), (1, 16, 96)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_decode_matches_the_reference(ops, dtype, kv_heads, group, head_dim, block_size):
    seq_lens = [1, 15, 16, 17, 300]
    query, k_cache, v_cache, tables, lens = paged_decode_case(
        seq_lens, block_size=block_size, kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype
    )
    n = len(seq_lens)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    ops.paged_decode_attention(out[:n], query[:n], k_cache, v_cache, tables, lens, scale)
    starts = torch.arange(n + 1, dtype=torch.int32)
    expected = reference_paged_attention(query[:n].float(), k_cache, v_cache, tables, starts, lens, scale)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out[:n].float(), expected, atol=atol, rtol=rtol)
    assert out[n:].isnan().all(), "rows past the decodes must be left alone"


@pytest.mark.parametrize("num_seqs", [1, 2, 9])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_decode_splits_work_the_same_way_for_any_thread_count(ops, num_seqs, threads):
    # Few sequences: one task per kv head; many: one task per sequence. Both give the same numbers.
    seq_lens = [37 + 11 * i for i in range(num_seqs)]
    query, k_cache, v_cache, tables, lens = paged_decode_case(
        seq_lens, block_size=16, kv_heads=3, group=3, head_dim=64, dtype=torch.float32, seed=num_seqs
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.empty_like(query[:num_seqs])
        ops.paged_decode_attention(out, query[:num_seqs], k_cache, v_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(previous)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    expected = reference_paged_attention(query[:num_seqs], k_cache, v_cache, tables, starts, lens, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (1, 4, 80), (2, 1, 40)])
def test_paged_decode_of_a_sequence_does_not_depend_on_its_batch_or_the_thread_count(ops, dtype, kv_heads, group,
                                                                                    head_dim):
    # Batch invariance: each sequence alone on one thread must get exactly what it gets among 9
    # others (no shared prefix) on 1, 2 or 4 threads, however the step is split into tasks.
    seq_lens = [1, 15, 16, 17, 33, 100, 250, 7, 64]
    query, k_cache, v_cache, tables, lens = paged_decode_case(
        seq_lens, block_size=16, kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype, seed=3
    )
    n = len(seq_lens)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.empty_like(query[:n])
        for i in range(n):
            ops.paged_decode_attention(alone[i : i + 1], query[i : i + 1], k_cache, v_cache, tables[i : i + 1],
                                       lens[i : i + 1], 0.125)
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            together = torch.empty_like(query[:n])
            ops.paged_decode_attention(together, query[:n], k_cache, v_cache, tables, lens, 0.125)
            assert torch.equal(together, alone), f"{threads} threads"
    finally:
        torch.set_num_threads(previous)


PREFIX_LAYOUTS = ["one prefix", "two forked requests"]


def share_prefixes(tables: torch.Tensor, shared_blocks: int, layout: str) -> None:
    """Points six sequences' first blocks at the same blocks: one prefix for all (prefix-cache hits on
    one system prompt), or two forked requests of three candidates each, a request's candidates
    sharing all `shared_blocks` and the two requests the first third of them (a system prompt)."""
    if layout == "one prefix":
        tables[:, :shared_blocks] = tables[0, :shared_blocks]
        return
    tables[:3, :shared_blocks] = tables[0, :shared_blocks]
    tables[3:, :shared_blocks] = tables[3, :shared_blocks]
    tables[:, : shared_blocks // 3] = tables[0, : shared_blocks // 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("block_size", "shared_blocks"), [(16, 5), (4, 9), (1, 40)])  # 80, 32 (of 36), 32 (of 40) shared tokens
@pytest.mark.parametrize("threads", [1, 2, 4])  # 4 threads for 6 sequences: one kv head per task
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 2, 128)])
@pytest.mark.parametrize("layout", PREFIX_LAYOUTS)
def test_paged_decode_over_a_shared_prefix_is_bit_identical_to_one_sequence_at_a_time(ops, dtype, block_size,
                                                                                      shared_blocks, threads,
                                                                                      kv_heads, group, head_dim,
                                                                                      layout):
    # Sequences whose tables start with the same blocks are handled together, the prefix tiles read
    # once for all of them; each must get exactly what it gets alone, where nothing is shared. The
    # kernels split a step by sequences and kv heads according to the thread count, so each split is
    # tried; the AMX kernel also multiplies the prefix for as many sequences at once as their query
    # heads fill a tile's 16 columns.
    seq_lens = [shared_blocks * block_size + extra for extra in (0, 1, 7, 16, 40, 3)]
    query, k_cache, v_cache, tables, lens = paged_decode_case(
        seq_lens, block_size=block_size, kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype,
        seed=block_size,
    )
    share_prefixes(tables, shared_blocks, layout)
    n = len(seq_lens)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = torch.empty_like(query[:n])
        ops.paged_decode_attention(together, query[:n], k_cache, v_cache, tables, lens, 0.125)
        alone = torch.empty_like(query[:n])
        for i in range(n):
            ops.paged_decode_attention(alone[i : i + 1], query[i : i + 1], k_cache, v_cache, tables[i : i + 1],
                                       lens[i : i + 1], 0.125)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, alone)
    starts = torch.arange(n + 1, dtype=torch.int32)
    expected = reference_paged_attention(query[:n].float(), k_cache, v_cache, tables, starts, lens, 0.125)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(together.float(), expected, atol=atol, rtol=rtol)


def fork_groups_tables(block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables of nine sequences behind a 2-block system prompt: a request forked into four
    candidates (5 prompt blocks), one forked into three (4 blocks), and two lone requests."""
    prompts = [5] * 4 + [4] * 3 + [3, 3]
    seq_lens = [blocks * block_size + extra for blocks, extra in zip(prompts, (0, 1, 9, 3, 2, 0, 5, 7, 1))]
    _, _, _, tables, lens = paged_decode_case(seq_lens, block_size=block_size, kv_heads=1, group=1, head_dim=16,
                                              dtype=torch.float32)
    tables[:4, :5] = tables[0, :5]
    tables[4:7, :4] = tables[4, :4]
    tables[:, :2] = tables[0, :2]
    return tables, lens


@pytest.mark.parametrize(("share_unit", "heads_together"), [(16, False), (32, True)])
def test_decode_reads_each_forked_requests_prompt_once_for_its_candidates(ops, share_unit, heads_together):
    # The candidates of a forked request lie next to each other in a step and share their whole
    # prompt; only the system prompt before it is common to the whole step. Each request's
    # candidates must be one run whose shared prefix is its whole prompt (rounded down to the
    # kernel's unit), not the 32 system-prompt tokens every sequence shares.
    tables, lens = fork_groups_tables(block_size=16)
    split = ops.decode_task_split(tables, lens, 16, 3, share_unit, 2, heads_together)
    runs = sorted({(begin, end, shared) for _, begin, end, shared in split})
    prompt = [80, 64, 32] if share_unit == 16 else [64, 64, 32]
    assert runs == [(0, 4, prompt[0]), (4, 7, prompt[1]), (7, 9, prompt[2])]
    heads = 3 if heads_together else 1  # the AMX kernel widens a prefix of every kv head at once
    assert sorted(h0 for h0, begin, _, _ in split if begin == 0) == list(range(0, 3, heads))


def test_decode_splits_one_shared_prefix_into_a_run_per_thread(ops):
    # One system prompt for the whole step (no forks): the sequences are cut into runs of about equal
    # length, as many as keep the threads busy, each reading the prefix once.
    seq_lens = [3 * 16 + extra for extra in (0, 1, 9, 3, 2, 0, 5, 7, 1)]
    _, _, _, tables, lens = paged_decode_case(seq_lens, block_size=16, kv_heads=1, group=1, head_dim=16,
                                              dtype=torch.float32)
    tables[:, :3] = tables[0, :3]
    split = ops.decode_task_split(tables, lens, 16, 3, 16, 2, True)
    assert sorted({(begin, end, shared) for _, begin, end, shared in split}) == [(0, 5, 48), (5, 9, 48)]
    assert ops.decode_task_split(tables, lens, 16, 3, 0, 2, True) == [(0, s, s + 1, 0) for s in range(9)]


def test_paged_decode_refuses_mismatched_inputs(ops):
    query, k_cache, v_cache, tables, lens = paged_decode_case(
        [5], block_size=4, kv_heads=2, group=2, head_dim=64, dtype=torch.float32
    )
    out = torch.empty_like(query[:1])
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.paged_decode_attention(out, query[:1].double(), k_cache, v_cache, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_decode_attention(out, query[:1], k_cache, v_cache, tables.long(), lens, 0.1)


def paged_prefill_case(ops, seq_lens, query_lens, *, block_size, kv_heads, group, head_dim, seed=0):
    """paged_decode_case's bf16 cache and tables, and the new rows of each sequence as the backend
    passes them: a strided view of a wider flat batch, after two decode rows."""
    _, k_cache, v_cache, tables, lens = paged_decode_case(
        seq_lens, block_size=block_size, kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=torch.bfloat16,
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    flat = torch.randn(2 + sum(query_lens), kv_heads * group + 1, head_dim, generator=gen).bfloat16()
    query = flat[2:, 1:]
    starts = torch.tensor([2 + sum(query_lens[:i]) for i in range(len(query_lens) + 1)], dtype=torch.int32)
    if not ops.paged_prefill_supported(query, k_cache):
        pytest.skip("the prefill kernel needs AMX tiles, which this CPU or kernel does not grant")
    return query, k_cache, v_cache, tables, lens, starts


# Whole prompts (rows == length) and chunks after cached tokens, rows past and short of 16-row blocks.
PREFILL_LENS = ([1, 15, 16, 17, 70, 300], [1, 15, 3, 17, 40, 123])


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 2, 128), (1, 16, 96), (2, 1, 32)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_prefill_matches_the_reference(ops, kv_heads, group, head_dim, block_size):
    query, k_cache, v_cache, tables, lens, starts = paged_prefill_case(
        ops, *PREFILL_LENS, block_size=block_size, kv_heads=kv_heads, group=group, head_dim=head_dim
    )
    out = torch.empty_like(query)
    ops.paged_prefill_attention(out, query, k_cache, v_cache, tables, lens, starts, 0.125)
    expected = reference_paged_attention(query.float(), k_cache, v_cache, tables, starts - 2, lens, 0.125)
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_paged_prefill_rows_equal_decoding_and_do_not_depend_on_chunks_or_threads(ops, threads):
    # Greedy output must not change with chunked prefill or prefix-cache hits: a row's attention is
    # the same bits however the prompt was cut, and the same as decoding that token.
    query, k_cache, v_cache, tables, lens, starts = paged_prefill_case(
        ops, *PREFILL_LENS, block_size=16, kv_heads=3, group=3, head_dim=64, seed=5
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = torch.empty_like(query)
        ops.paged_prefill_attention(whole, query, k_cache, v_cache, tables, lens, starts, 0.125)
        last_rows = query[(starts[1:] - 3).long()]
        decoded = torch.empty_like(last_rows)
        ops.paged_decode_attention(decoded, last_rows, k_cache, v_cache, tables, lens, 0.125)
        s = len(lens) - 1  # the 300-token sequence's 123 new rows, cut into 50 + 40 + 33
        first, seq_len = int(starts[s]) - 2, int(lens[s])
        chunks, done = [], 0
        for rows in (50, 40, 33):
            part = query[first + done : first + done + rows]
            out = torch.empty_like(part)
            ops.paged_prefill_attention(out, part, k_cache, v_cache, tables[s : s + 1],
                                        torch.tensor([seq_len - 123 + done + rows], dtype=torch.int32),
                                        torch.tensor([0, rows], dtype=torch.int32), 0.125)
            chunks.append(out)
            done += rows
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(decoded, whole[(starts[1:] - 3).long()])
    assert torch.equal(torch.cat(chunks), whole[first : first + 123])
    alone = torch.empty_like(whole)  # threads == 1 split nothing
    ops.paged_prefill_attention(alone, query, k_cache, v_cache, tables, lens, starts, 0.125)
    assert torch.equal(alone, whole)


def test_paged_prefill_refuses_inconsistent_rows(ops):
    query, k_cache, v_cache, tables, lens, starts = paged_prefill_case(
        ops, [5, 9], [5, 4], block_size=4, kv_heads=1, group=2, head_dim=64
    )
    out = torch.empty_like(query)
    one_row_more = starts.clone()
    one_row_more[-1] += 1
    with pytest.raises(RuntimeError, match="span the query rows"):
        ops.paged_prefill_attention(out, query, k_cache, v_cache, tables, lens, one_row_more, 0.1)
    with pytest.raises(RuntimeError, match="1..seq_len query rows"):
        ops.paged_prefill_attention(out, query, k_cache, v_cache, tables, lens - 1, starts, 0.1)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.paged_prefill_attention(out.float(), query, k_cache, v_cache, tables, lens, starts, 0.1)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])  # 3 and more: blocks of 4 rows
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (100, 7), (64, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_rows_linear_matches_float32_math(ops, rows, in_features, out_features, bias):
    if not ops.has_bf16_linear():
        pytest.skip("this CPU has no AVX512-BF16, so the kernel is not built (the engine uses F.linear)")
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    got = ops.linear_bf16_rows(x, w, b)
    expected = x.float() @ w.float().T + (b.float() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float(), expected, atol=1e-2 * math.sqrt(in_features), rtol=1e-2)


def bf16_product_case(rows, in_features, out_features, bias, seed=0):
    gen = torch.Generator().manual_seed(seed + rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    return x, w, b


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 65, 130])  # blocks of 16 rows, 4 blocks per pass
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (64, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_matches_float32_math(ops, rows, in_features, out_features, bias):
    if not ops.has_amx():
        pytest.skip("this CPU (or its OS) gives no AMX tiles, so the engine uses the other kernels")
    x, w, b = bf16_product_case(rows, in_features, out_features, bias)
    got = ops.linear_bf16_amx(x, w, b)
    expected = x.float() @ w.float().T + (b.float() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float(), expected, atol=1e-2 * math.sqrt(in_features), rtol=1e-2)


def test_amx_linear_refuses_shapes_its_tiles_do_not_fit(ops):
    if not ops.has_amx():
        pytest.skip("no AMX tiles here")
    x, w, _ = bf16_product_case(3, 100, 16, False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.linear_bf16_amx(x, w, None)


@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(1, 576, 960), (3, 100, 7), (5, 100, 7), (5, 576, 960), (129, 64, 16)])
def test_the_engine_linear_picks_a_kernel_by_shape_and_dtype(ops, rows, in_features, out_features):
    x, w, b = bf16_product_case(rows, in_features, out_features, True)
    tiles_fit = in_features % 32 == 0 and out_features % 16 == 0
    if ops.has_amx() and tiles_fit and rows <= 128:
        expected = ops.linear_bf16_amx(x, w, b)
    elif ops.has_bf16_linear() and rows <= 4:
        expected = ops.linear_bf16_rows(x, w, b)
    else:
        expected = torch.nn.functional.linear(x, w, b)
    assert torch.equal(ops.linear(x, w, b), expected)
    # A transposed (non-contiguous) weight and float32 go to at::linear.
    assert torch.equal(ops.linear(x, w.T.contiguous().T, b), torch.nn.functional.linear(x, w, b))
    assert torch.equal(ops.linear(x.float(), w.float(), b.float()),
                       torch.nn.functional.linear(x.float(), w.float(), b.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_the_module(ops, dtype, with_delta):
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    norm = norm.to(dtype)
    h = torch.randn(5, 96).to(dtype)
    delta = torch.randn(5, 96).to(dtype) if with_delta else None
    h_python, h_native = h.clone(), h.clone()
    expected = norm.add_and_norm(h_python, delta)  # no kernel set: the PyTorch path
    got = ops.add_rms_norm(h_native, delta, norm.weight.detach(), norm.eps)
    torch.testing.assert_close(h_native, h_python, atol=0, rtol=0)  # the residual add, in place
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol * 4, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_matches_the_module_on_strided_views(ops, dtype):
    from transformers import LlamaConfig

    rotary = RotaryEmbedding(LlamaConfig(head_dim=64, hidden_size=256, num_attention_heads=4), 64, 512)
    qkv = torch.randn(6, (4 + 2 + 2) * 64).to(dtype)  # q, k, v side by side, as the fused projection gives
    q, k, _ = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    q, k = q.view(6, 4, 64), k.view(6, 2, 64)
    positions = torch.tensor([0, 1, 7, 8, 300, 511])
    expected_q, expected_k = rotary(positions, q.clone(), k.clone())
    ops.rotary_(q, positions, rotary.cos, rotary.sin)
    ops.rotary_(k, positions, rotary.cos, rotary.sin)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(q.float(), expected_q.float(), atol=atol * 2, rtol=rtol)
    torch.testing.assert_close(k.float(), expected_k.float(), atol=atol * 2, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_matches_the_module(ops, dtype):
    mlp = GatedMLP(8, 40, bias=False)  # 40: two vector steps and a scalar tail
    mlp.fuse_projections()
    gate_up = (torch.randn(3, 80) * 6).to(dtype)
    gate, up = gate_up.split(40, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(ops.silu_mul(gate_up).float(), expected.float(), atol=atol, rtol=rtol)


def generate_tokens(model_dir, dtype: str) -> list[tuple[int, ...]]:
    prompts = [[5, 9, 2, 7] * 6, [3, 1], list(range(40, 90))]
    with Engine(str(model_dir), EngineConfig(dtype=dtype, disk_cache=False, block_size=4, num_blocks=64)) as engine:
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert not engine.take_warnings()
    return [o.token_ids for o in outs]


def test_the_engine_gives_the_same_greedy_tokens_with_and_without_the_kernels(tiny_llama, monkeypatch):
    with_kernels = generate_tokens(tiny_llama, "float32")
    monkeypatch.setenv("PAGECLI_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {})
    assert generate_tokens(tiny_llama, "float32") == with_kernels


def test_prompts_as_decode_rows_match_the_reference_and_do_not_depend_on_chunks(ops):
    # Without AMX, bf16 prompts run through the decode kernel a row per token (token_rows): each row
    # sees its causal context, and a chunk after cached tokens gets the bits the whole prompt gives.
    seq_lens, query_lens = PREFILL_LENS
    query_all, k_cache, v_cache, tables, lens = paged_decode_case(
        seq_lens, block_size=16, kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16, seed=9
    )
    if not ops.paged_decode_bf16_supported(query_all, k_cache):
        pytest.skip("the AVX512-BF16 decode kernel is not built at this level")
    width = tables.shape[1]
    block_lists = [row[: -(-n // 16)] for row, n in zip(tables.tolist(), seq_lens)]
    meta = AttentionMetadata.build(query_lens, seq_lens, block_lists, [0] * sum(query_lens), 0)
    row_tables, row_lens = meta.token_rows()
    assert row_tables.shape[0] == sum(query_lens) and row_tables.shape[1] <= width
    gen = torch.Generator().manual_seed(10)
    query = torch.randn(sum(query_lens), 9, 64, generator=gen).bfloat16()
    whole = torch.empty_like(query)
    ops.paged_decode_attention(whole, query, k_cache, v_cache, row_tables, row_lens, 0.125)
    expected = reference_paged_attention(query.float(), k_cache, v_cache, tables, meta.query_start_loc,
                                         meta.seq_lens, 0.125)
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(whole.float(), expected, atol=atol, rtol=rtol)
    # The 300-token sequence's 123 new rows, cut into 50 + 40 + 33 as three steps would.
    s, first = len(seq_lens) - 1, int(meta.query_start_loc[-2])
    done, chunks = 0, []
    for rows in (50, 40, 33):
        chunk = AttentionMetadata.build([rows], [seq_lens[s] - 123 + done + rows], [block_lists[s]], [0] * rows, 0)
        part_tables, part_lens = chunk.token_rows()
        out = torch.empty(rows, 9, 64).bfloat16()
        ops.paged_decode_attention(out, query[first + done : first + done + rows], k_cache, v_cache, part_tables,
                                   part_lens, 0.125)
        chunks.append(out)
        done += rows
    assert torch.equal(torch.cat(chunks), whole[first : first + 123])


@pytest.mark.parametrize("level", COMPILED_LEVELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_level_forced_gives_the_pytorch_paths_greedy_tokens(tiny_llama, monkeypatch, level, dtype):
    monkeypatch.setenv("PAGECLI_CPU_ISA", "torch")
    monkeypatch.setattr(native, "_state", {})
    reference = generate_tokens(tiny_llama, dtype)
    monkeypatch.setenv("PAGECLI_CPU_ISA", level)
    monkeypatch.setattr(native, "_state", {})
    assert generate_tokens(tiny_llama, dtype) == reference
    assert native.cpu_ops() is not None and native.level() == level


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_bf16_greedy_output_on_the_native_attention_does_not_depend_on_chunks_prefix_hits_or_batching(
        tiny_model_factory, kv_dtype):
    # test_engine_invariance.py's checks, in bf16 with head size 32, where prompts and decodes both
    # run on pagecli's attention kernels: AMX tiles, or (without AMX) the decode kernel with a row per
    # prompt token (AVX512-BF16's, or AVX2's widening bf16 to float32); the linear layers on AMX, the
    # packed GEMM or oneDNN by row count.
    from test_engine_invariance import GREEDY, PROMPTS

    folder = tiny_model_factory("qwen3")

    def run(prompts=PROMPTS, **config):
        settings = {"dtype": "bfloat16", "disk_cache": False, "block_size": 16, "num_blocks": 256,
                    "kv_dtype": kv_dtype, **config}
        with Engine(str(folder), EngineConfig(**settings)) as engine:
            query, cache = torch.empty(1, 1, 32).bfloat16(), engine.runner.kv_caches[0, 0]
            ops = engine.backend.cpu_ops
            if ops is None or not (ops.paged_prefill_supported(query, cache)
                                   or engine.backend._prompts_as_decode_rows(query, cache)):
                pytest.skip("prompts run on PyTorch's attention here (no compiled kernels for this cache)")
            outs = [o.token_ids for o in engine.generate(prompts, GREEDY)]
            if config.get("enable_prefix_caching"):
                assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == outs  # now from the cache
                assert engine.stats().prefix_hit_tokens > 0
            return outs

    alone = [run([p])[0] for p in PROMPTS]
    assert run(max_num_batched_tokens=5) == alone
    assert run(block_size=4, enable_prefix_caching=True) == alone
    assert run((PROMPTS * 6)[:32], max_num_seqs=32) == (alone * 6)[:32]


def test_a_build_killed_midway_does_not_leave_the_next_one_waiting_forever(tmp_path, monkeypatch):
    # torch's cpp_extension.load waits while its "lock" file exists in the build directory; a build
    # killed midway (Ctrl-C on the first run) leaves that file, and every later run hung on it.
    from torch.utils import cpp_extension

    seen = []

    def fake_load(name, build_directory, **kwargs):
        seen.append((Path(build_directory) / "lock").exists())
        library = Path(build_directory) / f"{name}.so"
        library.touch()
        return SimpleNamespace(__file__=str(library))

    monkeypatch.setattr(native, "build_dir", lambda level_name=None: tmp_path)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    (tmp_path / "lock").touch()  # what the killed build left
    native._build(None, native.level())
    assert seen == [False]


def test_a_failed_build_is_said_once_and_the_engine_runs_on_pytorch(tiny_llama, monkeypatch):
    def broken_build(progress, level_name):
        raise RuntimeError("Error building extension 'x':\nc++: error: unrecognized option\n")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_build", broken_build)
    with Engine(str(tiny_llama), EngineConfig(dtype="float32", disk_cache=False)) as engine:
        assert engine.backend.cpu_ops is None
        out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        warnings = engine.take_warnings()
    assert len(out[0].token_ids) == 3
    assert warnings == [
        "pagecli's CPU kernels are unavailable: building them failed (c++: error: unrecognized option); "
        "using the slower PyTorch path."
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, q/k/v bias, q/k norm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 2, 5])  # bf16: AMX tiles, or the rows kernel up to 4 rows and oneDNN above
def test_the_decode_step_in_cpp_matches_the_python_layer_loop_bit_for_bit(tiny_model_factory, arch, dtype, rows):
    with Engine(str(tiny_model_factory(arch)), EngineConfig(dtype=dtype, disk_cache=False, block_size=4, num_blocks=64)) as engine:
        model, backend, runner = engine.loaded.model, engine.backend, engine.runner
        assert model.decode_step is not None
        gen = torch.Generator().manual_seed(rows)
        caches = torch.randn(runner.kv_caches.shape, generator=gen).to(runner.kv_caches.dtype)
        assert_decode_step_matches_the_layer_loop(model, backend, caches, rows, gen)


@pytest.mark.parametrize("arch", ["olmoe", "qwen3_moe", "mixtral"])  # q/k norms over the projection, per head, none
@pytest.mark.parametrize(("dtype", "quantize"), [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"),
                                                 ("float32", "int4")])
@pytest.mark.parametrize("rows", [1, 5])  # one token's k experts in expert order; five rows grouped by expert
def test_the_decode_step_runs_a_mixture_of_experts_as_the_python_layer_loop_does(tiny_model_factory, arch, dtype,
                                                                                  quantize, rows):
    # The router, the top k and each chosen expert's products in C++ (moe_experts.h), the same tensor ops
    # in the same order as SparseMoE.forward: equal bits, with the experts in floats or quantized.
    config = EngineConfig(dtype=dtype, disk_cache=False, block_size=4, num_blocks=64, quantize=quantize)
    with Engine(str(tiny_model_factory(arch)), config) as engine:
        model, backend, runner = engine.loaded.model, engine.backend, engine.runner
        if backend.cpu_ops is None:
            pytest.skip("no native kernels: the Python layer loop runs")
        assert model.decode_step is not None and not model.decode_step.runs_as_team(rows)
        gen = torch.Generator().manual_seed(rows)
        caches = torch.randn(runner.kv_caches.shape, generator=gen).to(runner.kv_caches.dtype)
        assert_decode_step_matches_the_layer_loop(model, backend, caches, rows, gen)


@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize(("arch", "rows"), [("llama", 1), ("qwen3", 5)])
@pytest.mark.parametrize(("dtype", "quantize"), [("bfloat16", "none"), ("float32", "none"), ("float32", "int8"),
                                                 ("float32", "int4")])
def test_the_decode_step_as_one_team_matches_the_python_layer_loop_at_any_thread_count(tiny_model_factory, arch,
                                                                                        rows, count, dtype, quantize):
    # The whole step in one parallel region (DecodeStep::forward_team), its threads sharing each
    # product and attention call, rank 0 alone between them: bf16 on the packed GEMM, float32 on
    # F32PanelLinear (avx2 level) or on the int8/int4 products that round activations to int16
    # into the team's shared scratch.
    config = EngineConfig(dtype=dtype, disk_cache=False, block_size=4, num_blocks=64, quantize=quantize)
    with threads(count), Engine(str(tiny_model_factory(arch)), config) as engine:
        model, backend, runner = engine.loaded.model, engine.backend, engine.runner
        ops = backend.cpu_ops
        if ops is None:
            pytest.skip("no native kernels: the Python layer loop runs")
        if dtype == "bfloat16" and not weight_plan.bf16_panels_offered(ops):
            pytest.skip("bf16 weights in the packed GEMM's panels only on AVX512-BF16 CPUs without AMX (AMX reads "
                        "them as they lie): DecodeStep runs kernel by kernel")
        if quantize == "none" and dtype == "float32" and not weight_plan.float_panels_offered(ops):
            pytest.skip("float32 products on F32PanelLinear only at the avx2 level")
        if quantize != "none" and not ops.int8_linear_kind():
            pytest.skip("no AVX2 quantized products in this build")
        assert model.decode_step.runs_as_team(rows)
        gen = torch.Generator().manual_seed(count)
        caches = torch.randn(runner.kv_caches.shape, generator=gen).to(runner.kv_caches.dtype)
        assert_decode_step_matches_the_layer_loop(model, backend, caches, rows, gen)


def assert_decode_step_matches_the_layer_loop(model, backend, caches, rows: int, gen: torch.Generator) -> None:
    """One decode step of `rows` sequences (shuffled tables, a padding row when 5) through DecodeStep and
    through the Python layer loop, each on its own copy of `caches`: equal outputs and equal caches."""
    seq_lens = [5, 13, 30, 2, 17][:rows]
    order = torch.randperm(caches.shape[2], generator=gen).tolist()
    tables = [order[8 * i : 8 * i + -(-n // 4)] for i, n in enumerate(seq_lens)]
    slots = [t[(n - 1) // 4] * 4 + (n - 1) % 4 for t, n in zip(tables, seq_lens)]
    if rows == 5:
        slots[1] = -1  # a padding row: its K/V is not stored
    meta = AttentionMetadata.build([1] * rows, seq_lens, tables, slots, num_decode_seqs=rows)
    ids = torch.randint(0, model.spec.vocab_size, (rows,), generator=gen)
    positions = torch.tensor([n - 1 for n in seq_lens])

    def run(cache):
        with torch.inference_mode():
            return model(ids, positions, cache, meta, backend)

    cpp_cache = assert_one_call_equals_layer_loop(model, caches, run)
    assert not torch.equal(cpp_cache, caches)  # the new K/V was stored
