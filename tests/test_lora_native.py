"""The CPU kernels' LoRA adds (lora_add.h): each row gains its adapter's low-rank product, the same bits alone or
in any batch and on any number of threads, in float32 and in a bf16 or fp16 model's own dtype, and the one-call
decode step runs steps with adapter rows (a bf16 model's too)."""

from __future__ import annotations

import pytest
import torch

from engine_probes import assert_one_call_equals_layer_loop
from lora_helpers import one_thread  # noqa: F401 - a fixture
from native_levels import COMPILED_LEVELS, ops, skip_without_native, threads  # noqa: F401 - a fixture
from pagecli import native
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.loader import load_model

skip_without_native()


def stacks(slots: int, rank: int, in_features: int, out_features: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, rank, in_features, generator=g)  # [slots, rank, in]
    b = torch.randn(slots, rank, out_features, generator=g) * 0.1  # [slots, rank, out]
    return a, b


def reference(out, x, a, b, row_slot, row_scale):
    """out[r] += scale * (x[r] @ a[s].T) @ b[s] in float64."""
    expected = out.double().clone()
    for r, s in enumerate(row_slot.tolist()):
        if s >= 0:
            expected[r] += row_scale[r].double() * (x[r].double() @ a[s].double().T) @ b[s].double()
    return expected


def test_each_row_gains_its_adapters_low_rank_product(ops):
    a, b = stacks(3, 8, 100, 200)
    x = torch.randn(7, 100)
    out = torch.randn(7, 200)
    row_slot = torch.tensor([-1, 0, 0, 2, 1, 1, -1])
    row_scale = torch.tensor([0.0, 1.0, 1.0, 0.5, 2.0, 2.0, 0.0])
    expected = reference(out, x, a, b, row_slot, row_scale)
    got = out.clone()
    ops.lora_add_(got, x, a, b, row_slot, row_scale)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], out[0]) and torch.equal(got[6], out[6]), "base rows are left as they are"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_and_fp16_rows_gain_the_product_summed_in_float32_and_rounded_once(ops, dtype):
    """A bf16/fp16 model's rows and stacks, as the model holds them: each output within one rounding of the
    exact sum over the same values (float64), and no further from it than PyTorch's bmm way in that dtype (what
    a bf16 model's adapter rows ran on before: it rounds the down product, the delta and the sum)."""
    a, b = (t.to(dtype) for t in stacks(3, 8, 100, 203))  # 203 columns: the 32-, 8- and 1-column tails
    x = torch.randn(7, 100).to(dtype)
    out = torch.randn(7, 203).to(dtype)
    row_slot = torch.tensor([-1, 0, 0, 2, 1, 1, -1])
    row_scale = torch.tensor([0.0, 1.0, 1.0, 0.5, 2.0, 2.0, 0.0])
    got = out.clone()
    ops.lora_add_(got, x, a, b, row_slot, row_scale)
    assert got.dtype == dtype
    exact = reference(out, x, a, b, row_slot, row_scale)
    # one rounding to the dtype: at most half a unit in the last place (eps / 2 of the value), float32's sums
    # far inside that
    torch.testing.assert_close(got.double(), exact, rtol=torch.finfo(dtype).eps / 2, atol=1e-4)
    assert torch.equal(got[0], out[0]) and torch.equal(got[6], out[6]), "base rows are left as they are"
    slots = row_slot.clamp(min=0)
    down = torch.bmm(x.unsqueeze(1), a[slots].transpose(1, 2)) * row_scale.to(dtype).view(-1, 1, 1)
    pytorch = out + torch.bmm(down, b[slots]).squeeze(1)  # [rows, out] in the dtype, as lora_batch's short spans
    pytorch = torch.where(row_slot.view(-1, 1) >= 0, pytorch, out)
    assert (got.double() - exact).abs().max() <= (pytorch.double() - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_stacks_of_a_fused_product_add_what_the_plain_kernel_adds(ops, dtype):
    """A fused product's stacks are zero off each part's block (q's rank rows over k's and v's columns); LoraStacks
    skips those rows tile by tile in bf16/fp16. Parts of 100, 40 and 70 columns cut 64-column tiles mid-way, and
    slot 1 has a smaller rank in the second part (zero rows inside a block)."""
    g = torch.Generator().manual_seed(3)
    parts, rank = [100, 40, 70], 8
    a = torch.randn(3, rank * len(parts), 50, generator=g)  # [slots, rank of each part stacked, in]
    b = torch.zeros(3, rank * len(parts), sum(parts))  # [slots, rank, out]: part i's rows over its columns only
    start = 0
    for i, width in enumerate(parts):
        b[:, i * rank:(i + 1) * rank, start:start + width] = torch.randn(3, rank, width, generator=g) * 0.1
        start += width
    b[1, rank + 5:2 * rank] = 0
    a, b = a.to(dtype), b.to(dtype)
    x = torch.randn(9, 50, generator=g).to(dtype)
    out = torch.randn(9, sum(parts), generator=g).to(dtype)
    row_slot = torch.tensor([0, 0, -1, 1, 1, 1, 2, -1, 2])
    row_scale = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 2.0, 0.0, 2.0])
    plain = out.clone()
    ops.lora_add_(plain, x, a, b, row_slot, row_scale)
    held = out.clone()
    ops.LoraStacks([[a, b, None, None, None, None, None, None]]).add(0, 0, x, held, row_slot, row_scale)
    assert torch.equal(held, plain)
    assert not torch.equal(plain, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads(ops, dtype):
    a, b = (t.to(dtype) for t in stacks(4, 16, 576, 960, seed=1))
    x = torch.randn(40, 576).to(dtype)
    out = torch.randn(40, 960).to(dtype)
    row_slot = torch.tensor([s for s in range(4) for _ in range(10)])
    row_scale = torch.ones(40)
    with threads(2):
        batch = out.clone()
        ops.lora_add_(batch, x, a, b, row_slot, row_scale)
    for r in (0, 13, 39):
        alone = out[r:r + 1].clone()
        ops.lora_add_(alone, x[r:r + 1], a, b, row_slot[r:r + 1], row_scale[r:r + 1])
        assert torch.equal(alone[0], batch[r]), r


@pytest.fixture(scope="module")
def two_adapters(tiny_model_factory, tmp_path_factory):
    from lora_helpers import make_adapter

    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("native-adapters")
    return base, {"a": make_adapter(base, root / "a", rank=8, seed=11), "b": make_adapter(base, root / "b", rank=4,
                                                                                         seed=12)}


def test_decode_steps_with_adapter_rows_run_in_the_one_call_step(two_adapters, monkeypatch):
    """Mixed decode steps take DecodeStep.forward_lora, and each request gets the tokens it gets alone."""
    base, adapters = two_adapters
    engine = Engine(config=EngineConfig(dtype="float32", device="cpu", num_blocks=256, block_size=4, disk_cache=False,
                                        enable_prefix_caching=False,
                                        loras=tuple((n, str(p)) for n, p in adapters.items())),
                    loaded=load_model(base, "float32", "cpu", max_positions=512))
    step = engine.loaded.model.decode_step
    if step is None:
        pytest.skip("this plan has no one-call decode step")
    calls = []
    model = engine.loaded.model

    class Spy:
        def forward(self, *args):
            return step.forward(*args)

        def forward_lora(self, *args):
            calls.append(args[-2])  # the rows' slots
            return step.forward_lora(*args)

    monkeypatch.setattr(model, "decode_step", Spy())
    sampling = {name: SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora=name) for name in ("a", "b")}
    sampling[None] = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = engine.encode("Hello world! How are you")
    alone = {name: engine.generate([ids], s)[0].token_ids for name, s in sampling.items()}
    calls.clear()
    for name, s in sampling.items():
        engine.add_request(ids, s, request_id=str(name))
    tokens: dict[str, list[int]] = {str(name): [] for name in sampling}
    for event in engine.stream():
        tokens[event.request_id].extend(event.token_ids)
    assert {name: tuple(tokens[str(name)]) for name in sampling} == {k: tuple(v) for k, v in alone.items()}
    assert any(sorted(set(rows.tolist())) == [-1, 0, 1] for rows in calls), "a mixed step ran in one call"
    assert len(set(map(tuple, alone.values()))) == 3, "each adapter changes the output"


@pytest.fixture(scope="module")
def four_adapters(two_adapters, tmp_path_factory):
    from lora_helpers import ATTENTION, MLP, make_adapter

    base, adapters = two_adapters
    root = tmp_path_factory.mktemp("native-adapters-more")
    return base, {**adapters, "c": make_adapter(base, root / "c", rank=16, targets=ATTENTION, seed=13),
                  "d": make_adapter(base, root / "d", rank=8, targets=["q_proj", "v_proj", *MLP], seed=14)}


@pytest.mark.parametrize("level", COMPILED_LEVELS)
def test_a_bf16_batch_of_four_adapters_and_the_base_stays_in_the_one_call_step_and_gives_each_its_tokens_alone(
        four_adapters, level, monkeypatch):
    """A bf16 model (the default dtype on a CPU with AVX512-BF16): its adapters' stacks go to the CPU kernels in
    bf16, mixed decode steps take DecodeStep.forward_lora with bf16 rows, and each request of a batch mixing four
    adapters and the base gets the greedy tokens it gets alone."""
    monkeypatch.setattr(native, "_state", {"module": native.cpu_ops_for(level)})
    base, adapters = four_adapters
    engine = Engine(config=EngineConfig(dtype="bfloat16", device="cpu", num_blocks=256, block_size=4,
                                        disk_cache=False, enable_prefix_caching=False,
                                        loras=tuple((n, str(p)) for n, p in adapters.items())),
                    loaded=load_model(base, "bfloat16", "cpu", max_positions=512))
    model = engine.loaded.model
    step = model.decode_step
    if step is None:
        pytest.skip("this plan has no one-call decode step")
    calls = []

    class Spy:
        def forward(self, *args):
            return step.forward(*args)

        def forward_lora(self, *args):
            calls.append((args[0].dtype, sorted(set(args[-2].tolist()))))  # the rows' dtype and slots
            return step.forward_lora(*args)

    monkeypatch.setattr(model, "decode_step", Spy())
    names = [*adapters, None]
    requests = [(engine.encode(prompt), name) for prompt in ("Hello world! How are you", "def main():\n    print(")
                for name in names]
    alone = [engine.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora=name))[0]
             .token_ids for ids, name in requests]
    assert engine.adapters.slots.native is not None, "the bf16 stacks are held by the CPU kernels"
    calls.clear()
    for index, (ids, name) in enumerate(requests):
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora=name),
                           request_id=str(index))
    tokens: dict[str, list[int]] = {str(index): [] for index in range(len(requests))}
    for event in engine.stream():
        tokens[event.request_id].extend(event.token_ids)
    assert [tuple(tokens[str(index)]) for index in range(len(requests))] == [tuple(t) for t in alone]
    assert (torch.bfloat16, [-1, 0, 1, 2, 3]) in calls, "a mixed bf16 step ran in one call"
    assert len(set(map(tuple, alone[:len(names)]))) == len(names), "each adapter changes the output"


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 12])  # up to 8 rows: one team (DecodeStep::forward_team); 12: call by call
@pytest.mark.parametrize(("dtype", "quantize"), [("float32", "none"), ("float32", "int8"), ("bfloat16", "none")])
def test_the_one_call_step_with_adapter_rows_matches_the_python_layer_loop_bit_for_bit(two_adapters, rows, count,
                                                                                       dtype, quantize):
    from pagecli.attention.metadata import AttentionMetadata
    from pagecli.models.lora_batch import LoraBatch

    base, adapters = two_adapters
    config = EngineConfig(dtype=dtype, disk_cache=False, block_size=4, num_blocks=128, quantize=quantize,
                          loras=tuple((n, str(p)) for n, p in adapters.items()))
    with threads(count), Engine(str(base), config) as engine:
        model, backend, runner = engine.loaded.model, engine.backend, engine.runner
        if model.decode_step is None:
            pytest.skip("this plan has no one-call decode step")
        loaded = [engine.adapters.get(name, set()) for name in adapters]
        assert engine.adapters.slots.native is not None
        gen = torch.Generator().manual_seed(rows * 10 + count)
        caches = torch.randn(runner.kv_caches.shape, generator=gen).to(runner.kv_caches.dtype)
        seq_lens = [5 + 3 * i for i in range(rows)]
        tables = [list(range(8 * i, 8 * i + -(-n // 4))) for i, n in enumerate(seq_lens)]
        slots = [t[(n - 1) // 4] * 4 + (n - 1) % 4 for t, n in zip(tables, seq_lens)]
        meta = AttentionMetadata.build([1] * rows, seq_lens, tables, slots, num_decode_seqs=rows)
        ids = torch.randint(0, model.spec.vocab_size, (rows,), generator=gen)
        positions = torch.tensor([n - 1 for n in seq_lens])
        # rows: adapter a at scale 1, the base, adapter b at 0.5, a again (a run of its own)
        row_adapters = [[loaded[0], None, loaded[1], loaded[0]][i % 4] for i in range(rows)]
        lora = LoraBatch.from_rows([(a, 0.5 if a is loaded[1] else 1.0, 1) for a in row_adapters],
                                   engine.adapters.slots)
        assert lora is not None and lora.native is not None

        def run(cache):
            with torch.inference_mode():
                return model(ids, positions, cache, meta, backend, lora)

        assert_one_call_equals_layer_loop(model, caches, run)
