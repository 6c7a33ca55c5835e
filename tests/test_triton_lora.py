"""The segmented Triton LoRA kernels (pagecli.kernels.lora), interpreted on the CPU in CI: every adapter row of a
mixed batch gains its own adapter's scaled low-rank product and base rows are untouched, in each dtype; and the
engine on the Triton attention backend runs its adapter rows through them, a mixed batch giving each request its
output alone, the same tokens as the PyTorch way."""

from __future__ import annotations

import os

import pytest
import torch

from lora_helpers import make_adapter, one_thread  # noqa: F401 - a fixture
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.loader import load_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton needs a GPU or TRITON_INTERPRET=1 (conftest sets it on CPU)",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Four adapters of ranks 8 and 64 in one stack (padded to 64, as lora_slots pads), over 40 + 1 + 40 + 1 rows
# and base rows between them; one adapter at two scales.
SEGMENTS = [(1, 2, 0, 2.0), (2, 42, 1, 0.5), (42, 43, 2, 1.0), (45, 85, 3, 1.5), (85, 86, 0, 0.25)]
RANKS = [8, 64, 8, 64]
# One output ulp or so: the reference sums in float64 over the same (rounded) inputs.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def stacks(in_features: int, out_features: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.zeros(len(RANKS), max(RANKS), in_features)  # [slots, rank, in]
    b = torch.zeros(len(RANKS), max(RANKS), out_features)  # [slots, rank, out]
    for slot, rank in enumerate(RANKS):
        a[slot, :rank] = torch.randn(rank, in_features, generator=g) / in_features**0.5
        b[slot, :rank] = torch.randn(rank, out_features, generator=g) / rank**0.5
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def reference(out, x, a, b, segments):
    """out[r] += scale * (x[r] @ a[slot].T) @ b[slot] in float64 for the rows of each segment."""
    expected = out.double().clone()
    for start, end, slot, scale in segments:
        expected[start:end] += scale * (x[start:end].double() @ a[slot].double().T) @ b[slot].double()
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_each_segment_gains_its_adapters_scaled_product_and_base_rows_stay(dtype):
    from pagecli.kernels.lora import lora_add, lora_tiles

    in_features, out_features = 96, 160  # not multiples of the tiles: masked edges
    a, b = stacks(in_features, out_features, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(88, in_features, generator=g).to(DEVICE, dtype)
    out = torch.randn(88, out_features, generator=g).to(DEVICE, dtype)
    expected = reference(out, x, a, b, SEGMENTS)
    got = lora_add(out.clone(), x, a, b, lora_tiles(SEGMENTS, dtype, x.device))
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    base_rows = [0, 43, 44, 86, 87]
    assert torch.equal(got[base_rows], out[base_rows]), "rows of the base model are left as they are"
    assert (got.double() - out.double())[[1, 2, 42, 45, 85]].abs().amax(dim=1).min() > 0.01


def test_decode_rows_take_small_tiles_and_long_segments_are_cut():
    from pagecli.kernels.lora import MAX_BLOCK_M, lora_tiles

    decode = lora_tiles([(0, 1, 0, 1.0), (1, 3, 1, 1.0), (3, 4, 2, 1.0)], torch.bfloat16, None)
    assert (decode.block_m, decode.num_tiles) == (16, 3)
    prefill = lora_tiles([(0, 1, 0, 1.0), (1, 1 + 2 * MAX_BLOCK_M + 5, 1, 0.5)], torch.bfloat16, None)
    assert (prefill.block_m, prefill.num_tiles) == (MAX_BLOCK_M, 4)
    assert prefill.meta.tolist() == [[0, 1, 1 + MAX_BLOCK_M, 1 + 2 * MAX_BLOCK_M], [1, MAX_BLOCK_M, MAX_BLOCK_M, 5],
                                     [0, 1, 1, 1]]
    assert prefill.scale.tolist() == [1.0, 0.5, 0.5, 0.5]
    assert lora_tiles([(0, 200, 0, 1.0)], torch.float32, None).block_m == MAX_BLOCK_M // 2, "float32: fewer registers"


def test_a_tile_of_the_base_slot_adds_nothing():
    from pagecli.kernels.lora import lora_add, lora_tiles

    a, b = stacks(32, 48, torch.float32)
    x = torch.randn(4, 32, device=DEVICE)
    out = torch.randn(4, 48, device=DEVICE)
    got = lora_add(out.clone(), x, a, b, lora_tiles([(0, 2, -1, 1.0), (2, 4, 1, 1.0)], x.dtype, x.device))
    assert torch.equal(got[:2], out[:2])
    torch.testing.assert_close(got.double(), reference(out, x, a, b, [(2, 4, 1, 1.0)]), rtol=1e-5, atol=1e-5)


# --- the engine on the Triton path ------------------------------------------------------------------------
PROMPTS = ["Hello world! How are you", "Paged attention keeps the KV cache in fixed-size blocks."]


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory):
    """The tiny llama and two adapters over q/k/v/o and the MLP (the fused qkv and gate_up products)."""
    pytest.importorskip("peft")  # writes the adapters; a GPU machine may lack it (the kernel tests above run)
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("triton-adapters")
    return base, {"r8": make_adapter(base, root / "r8", rank=8, seed=1),
                  "r64": make_adapter(base, root / "r64", rank=64, seed=2, alpha=96)}


def engine_for(base, adapters, attention: str) -> Engine:
    config = EngineConfig(dtype="float32", device=DEVICE, attention=attention, num_blocks=128, block_size=4,
                          disk_cache=False, enable_prefix_caching=False,
                          loras=tuple((name, str(path)) for name, path in adapters.items()))
    return Engine(config=config, loaded=load_model(base, "float32", DEVICE, max_positions=256))


def greedy(lora: str | None, scale: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, lora=lora, lora_scale=scale)


def together(engine: Engine, requests: list) -> list[tuple[int, ...]]:
    """Every request in one batch; each one's tokens."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    for event in engine.stream():
        tokens[event.request_id].extend(event.token_ids)
    return [tuple(tokens[i]) for i in ids]


def test_the_engine_on_triton_gives_a_mixed_batch_each_requests_output_alone_and_the_pytorch_tokens(adapters,
                                                                                                     monkeypatch):
    from pagecli.kernels import lora as triton_lora

    base, paths = adapters
    launches = []
    real_add = triton_lora.lora_add
    monkeypatch.setattr(triton_lora, "lora_add", lambda *args: launches.append(args[-1]) or real_add(*args))
    requests = [(PROMPTS[0], "r8", 1.0), (PROMPTS[1], "r64", 1.0), (PROMPTS[0], None, 1.0),
                (PROMPTS[1], "r8", 0.5)]
    engine = engine_for(base, paths, "triton")
    encoded = [(engine.encode(prompt), greedy(name, scale)) for prompt, name, scale in requests]
    alone = [engine.generate([ids], params)[0].token_ids for ids, params in encoded]
    assert launches, "the adapter rows ran on the Triton kernels"
    assert together(engine, encoded) == alone
    assert any(tiles.num_tiles >= 3 for tiles in launches), "one launch served several adapters' rows"
    reference = engine_for(base, paths, "torch")
    assert [reference.generate([ids], params)[0].token_ids for ids, params in encoded] == alone
    assert len(set(alone[:3])) == 3, "each adapter (and the base) gives its own output"
