"""The greedy choice taken inside the output layer's product (native/greedy_choices.h): every product form
the output layer takes (float-panels, bf16-panels, int8 on the VNNI and AVX2 kernels, GGUF Q8_0 as it lies)
gives, beside its logits, each row's choice equal to greedy_tokens over those logits, at every compiled
level and thread count, with ties planted across tiles, panels and threads' shares, and NaNs; and the
engine takes those choices where the rows are the step's own, with the same tokens as without them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from native_levels import ops, skip_without_native, threads  # noqa: F401 - ops: the fixture, once per compiled level

skip_without_native()

HIDDEN = 64
# Equal columns (identical weight rows): inside one 16-column panel, across a panel edge, across the float
# kernel's two-panel groups, across the packed kernels' 48-column panels, and far apart (other threads'
# shares, the short last panel). Row r of a batch leans on pair r % len(TIES): those columns are its largest.
TIES = [(3, 5), (15, 16), (31, 32), (47, 48), (100, -1), (50, 700, 701)]


def planted(vocab: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [vocab, HIDDEN], x [rows, HIDDEN]) whose products tie at the largest logit of most rows."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, HIDDEN, generator=gen) * 0.1
    x = torch.randn(rows, HIDDEN, generator=gen)
    for pair, columns in enumerate(TIES):
        shared = torch.randn(HIDDEN, generator=gen) * 0.1
        shared[pair] = 2.0  # the pair's coordinate: rows leaning on it reach these columns first
        for column in columns:
            weight[column] = shared
    for r in range(rows):
        x[r, r % len(TIES)] += 40.0
    return weight, x


def q8_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q8_0 tensor's parts for weight [N, K] (K a multiple of 32): q int8 [N, K], fp16 scales [N, K / 32]."""
    blocks = weight.view(weight.shape[0], -1, 32)  # [N, K / 32, 32]
    scale = (blocks.abs().amax(dim=2) / 127).to(torch.float16)  # [N, K / 32]
    q = (blocks / scale.float().clamp_min(1e-8).unsqueeze(2)).round().clamp(-127, 127).to(torch.int8)
    return q.view_as(weight).contiguous(), scale


def products(ops, weight: torch.Tensor) -> dict[str, tuple[object, torch.dtype]]:
    """Every form of the output layer this level builds: the product and the activations' dtype it takes."""
    from pagecli.models.quantize import quantize_int8

    forms: dict[str, tuple[object, torch.dtype]] = {}
    if ops.has_bf16_weight_linear():
        forms["float-panels (bf16-exact)"] = (ops.F32PanelLinear(weight.bfloat16().float(), None), torch.float32)
        forms["float-panels (float32)"] = (ops.F32PanelLinear(weight, None), torch.float32)
    if ops.has_packed_linear():
        forms["bf16-panels"] = (ops.PackedLinear(weight.bfloat16(), None), torch.bfloat16)
    q, scale = quantize_int8(weight)
    if ops.int8_linear_kind() == "avx512_vnni":
        forms["int8 (VNNI), bf16"] = (ops.PackedLinearInt8(q, scale, None), torch.bfloat16)
        forms["int8 (VNNI), float32"] = (ops.PackedLinearInt8(q, scale, None), torch.float32)
    if ops.int8_linear_kind():
        forms["int8 (AVX2 kernel)"] = (ops.PackedLinearInt8(q, scale, None, int16_activations=True), torch.float32)
        forms["Q8_0 as it lies"] = (ops.PackedLinearInt8(*q8_0_blocks(weight), None, int16_activations=True),
                                    torch.float32)
    return forms


def assert_choices_are_greedy_tokens(ops, product, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    logits, choices = product.forward_choosing(x)
    assert choices is not None and choices.dtype == torch.int64
    torch.testing.assert_close(logits, product.forward(x), rtol=0, atol=0, equal_nan=True)  # forward()'s logits
    assert choices.tolist() == ops.greedy_tokens(logits) == logits.max(dim=-1).indices.tolist()
    return logits, choices.tolist()


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("vocab", [997, 5003])
def test_every_output_form_takes_greedy_tokens_choice_with_ties_across_tiles_and_threads(ops, vocab, num_threads):
    weight, _ = planted(vocab, 1, seed=vocab)
    forms = products(ops, weight)
    assert "Q8_0 as it lies" in forms and any(name.startswith("float-panels") for name in forms)
    with threads(num_threads):
        for rows in (1, 3, 17, 64, 256):
            _, x = planted(vocab, rows, seed=vocab)
            for name, (product, dtype) in forms.items():
                logits, chosen = assert_choices_are_greedy_tokens(ops, product, x.to(dtype))
                tied = 0
                for r in range(rows):
                    columns = [c % vocab for c in TIES[r % len(TIES)]]
                    values = logits[r, columns]
                    if bool((values == values[0]).all()) and values[0] == logits[r].max():
                        assert chosen[r] == columns[0], (name, rows, r)
                        tied += 1
                assert tied >= min(rows, 3), (name, rows)  # the planted ties are there to be chosen among


def test_a_nan_logit_is_chosen_as_greedy_tokens_chooses_it(ops):
    """A NaN column (its bias) in every row, and on the float forms a row of NaN activations: torch.max's NaN."""
    vocab = 1031
    weight, x = planted(vocab, 17, seed=7)
    bias = torch.zeros(vocab)
    bias[600] = float("nan")
    from pagecli.models.quantize import quantize_int8

    q, scale = quantize_int8(weight)
    with threads(2):
        if ops.has_bf16_weight_linear():
            plain = ops.F32PanelLinear(weight, None)
            nan_row = x.clone()
            nan_row[4, 9] = float("nan")
            logits, chosen = assert_choices_are_greedy_tokens(ops, plain, nan_row)
            assert logits[4].isnan().all() and not logits[3].isnan().any()
            _, chosen = assert_choices_are_greedy_tokens(ops, ops.F32PanelLinear(weight, bias), x)
            assert chosen == [600] * 17
        if ops.has_packed_linear():
            _, chosen = assert_choices_are_greedy_tokens(ops, ops.PackedLinear(weight.bfloat16(), bias), x.bfloat16())
            assert chosen == [600] * 17
        if ops.int8_linear_kind():
            product = ops.PackedLinearInt8(q, scale, bias, int16_activations=True)
            _, chosen = assert_choices_are_greedy_tokens(ops, product, x)
            assert chosen == [600] * 17


def test_a_product_that_would_round_its_logits_gives_no_choices(ops):
    """The AVX2 int8 kernel writes float32: bf16 activations get float32 logits rounded to bf16, whose first
    maximum may be another column; then no choices, and the caller makes its pass."""
    if not ops.int8_linear_kind():
        pytest.skip("no int8 kernel at this level")
    from pagecli.models.quantize import quantize_int8

    weight, x = planted(997, 5, seed=3)
    product = ops.PackedLinearInt8(*quantize_int8(weight), None, int16_activations=True)
    logits, choices = product.forward_choosing(x.bfloat16())
    assert choices is None and torch.equal(logits, product.forward(x.bfloat16()))


def run_engine(folder, dtype: str, requests, monkeypatch, in_output: bool):
    """Each request's tokens, and per step whether the runner gave choices and how many greedy_tokens passes ran."""
    from pagecli import native
    from pagecli.config import EngineConfig
    from pagecli.engine import Engine

    from pagecli.engine import engine as engine_module

    monkeypatch.setenv("PAGECLI_GREEDY_IN_OUTPUT", "1" if in_output else "0")
    monkeypatch.setattr(engine_module, "GREEDY_IN_OUTPUT_MIN_ROWS", 1)  # this batch's few rows take it too
    engine = Engine(str(folder), EngineConfig(dtype=dtype, device="cpu", quantize="none", disk_cache=False,
                                              num_blocks=128))
    kernels = native.cpu_ops()
    passes = []
    engine._sampling_ops = SimpleNamespace(
        greedy_tokens=lambda logits: passes.append(logits.shape[0]) or kernels.greedy_tokens(logits),
        sample_rows=kernels.sample_rows)
    given = []
    execute = engine.runner.execute

    def spy(scheduled, greedy=False):
        logits, choices = execute(scheduled, greedy)
        given.append(choices is not None)
        return logits, choices

    engine.runner.execute = spy
    with engine:
        ids = [engine.add_request(prompt, sampling) for prompt, sampling in requests]  # one batch
        tokens: dict[tuple[str, int], list[int]] = {}
        for event in engine.stream():
            tokens.setdefault((event.request_id, event.index), []).extend(event.token_ids)
    return sorted((ids.index(rid), index, out) for (rid, index), out in tokens.items()), given, passes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_takes_the_output_layers_choices_and_its_tokens_do_not_change(tiny_model_factory, monkeypatch,
                                                                                dtype):
    from pagecli import native
    from pagecli.config import SamplingParams

    if dtype == "bfloat16" and not native.cpu_ops().has_packed_linear():
        pytest.skip("bf16 models' output layer is on the packed GEMM only with AVX512-BF16")
    folder = tiny_model_factory("llama")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = [(f"prompt number {i} about the sea", greedy) for i in range(5)] + [
        ("a sampled one", SamplingParams(temperature=0.8, seed=11, max_tokens=8, ignore_eos=True)),
        # Its rows' logits change after the product: no choices taken while it runs (its first 2 steps).
        ("a penalised greedy one", SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=2,
                                                  ignore_eos=True)),
        ("forked candidates", SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=6, ignore_eos=True)),
        ("greedy candidates", SamplingParams(temperature=0, n=2, max_tokens=6, ignore_eos=True)),
    ]
    with threads(2):
        fused, given, passes = run_engine(folder, dtype, requests, monkeypatch, in_output=True)
        plain, given_off, passes_off = run_engine(folder, dtype, requests, monkeypatch, in_output=False)
    assert fused == plain
    assert not any(given_off) and passes_off
    assert sum(given) > len(given) // 2  # the steps of the batch (every one here)
    assert 0 < len(passes) < len(passes_off) - 3  # the steps with the penalised row, or rows forked, only


def test_a_step_of_few_rows_or_with_drafts_does_not_ask_the_output_layer_for_choices(tiny_model_factory):
    """Below GREEDY_IN_OUTPUT_MIN_ROWS the product and greedy_tokens' pass are the faster way, and a checking
    step's rows are re-indexed by verify: neither asks for the choices."""
    from pagecli.config import EngineConfig, SamplingParams
    from pagecli.engine import Engine
    from pagecli.engine.engine import GREEDY_IN_OUTPUT_MIN_ROWS

    folder = tiny_model_factory("llama")
    asked = []
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with threads(1), Engine(str(folder), EngineConfig(dtype="float32", quantize="none", disk_cache=False,
                                                      num_blocks=256, speculate="ngram")) as engine:
        execute = engine.runner.execute

        def spy(scheduled, greedy=False):
            asked.append((sum(1 for item in scheduled if item.samples), greedy))
            return execute(scheduled, greedy)

        engine.runner.execute = spy
        engine.generate(["one two three one two three one two three one two"], greedy)  # drafts: few rows
        engine.generate([f"request {i}" for i in range(GREEDY_IN_OUTPUT_MIN_ROWS)], greedy)  # a batch of 16
    assert not any(wanted for rows, wanted in asked if rows < GREEDY_IN_OUTPUT_MIN_ROWS)
    assert any(wanted for rows, wanted in asked if rows >= GREEDY_IN_OUTPUT_MIN_ROWS)
