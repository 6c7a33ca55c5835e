"""--kv-dtype: the KV cache in another float dtype, or quantized (int8, fp8) with a scale per row.

The format's reference (kv_format.quantize_rows / dequantize_rows), what the pool holds for the same
budget, and that a quantized run's greedy output does not depend on batching, chunked prefill,
preemption, prefix hits or disk hits (the engine invariance suite, run with int8 and fp8).
"""

from __future__ import annotations

import pytest
import torch

from pagecli.kv_format import (
    KVFormat, dequantize_rows, format_of_cache, quantize_rows, resolve_kv_format,
)
from pagecli.config import EngineConfig, SamplingParams
from pagecli.models.fingerprint import kv_fingerprint_name
from pagecli.engine import Engine
from pagecli.errors import PagecliError

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[1, 5, 9, 13, 17], [3, 4], [7] * 23, [11, 30, 2, 8, 8, 8, 40, 41, 42], list(range(3, 40))]


# --- the format ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_rows_round_trip_within_half_a_step(dtype):
    torch.manual_seed(0)
    x = (torch.randn(40, 3, 64) * torch.logspace(-3, 2, 40)[:, None, None]).to(dtype)
    rows = quantize_rows(x, "int8")
    assert rows.dtype == torch.int8 and rows.shape == (40, 3, 66)
    back = dequantize_rows(rows, torch.float32)
    amax = x.float().abs().amax(-1, keepdim=True)
    step = amax / 127
    # half a step of rounding, plus the scale's float16 rounding applied to values up to 127 steps
    assert bool(((back - x.float()).abs() <= step * (0.5 + 127 * 2.0**-11) + 1e-12).all())
    assert torch.equal(back.abs().amax(-1, keepdim=True) > 0, amax > 0)


def test_fp8_rows_round_trip_within_e4m3_precision():
    torch.manual_seed(1)
    x = torch.randn(32, 2, 32) * 7
    back = dequantize_rows(quantize_rows(x, "fp8"), torch.float32)
    assert format_of_cache(quantize_rows(x, "fp8")) == "fp8"
    # e4m3 keeps 3 mantissa bits: 1/16 relative for normal values; the smallest are subnormal steps of scale/512.
    scale = x.abs().amax(-1, keepdim=True) / 448
    assert bool(((back - x).abs() <= x.abs() / 16 + scale / 512 + 1e-6).all())


def test_a_row_of_zeros_stores_zero_scale_and_reads_back_zeros():
    rows = quantize_rows(torch.zeros(2, 1, 16), "int8")
    assert not bool(rows.view(torch.uint8).any())
    assert not bool(dequantize_rows(rows, torch.float32).any())


def test_formats_resolve_and_count_bytes():
    auto = resolve_kv_format("auto", torch.bfloat16, 64)
    assert auto == KVFormat("bfloat16", 64) and not auto.quantized and auto.row_width == 64
    int8 = resolve_kv_format("int8", torch.bfloat16, 64)
    assert int8.storage_dtype == torch.int8 and int8.row_width == 66
    # 30 layers x 3 kv heads (SmolLM2-135M): int8 holds 128/66 = 1.94x the tokens of bfloat16
    assert auto.bytes_per_token(30, 3) == 30 * 2 * 3 * 64 * 2
    assert int8.bytes_per_token(30, 3) == 30 * 2 * 3 * 66
    assert resolve_kv_format("fp8", torch.float32, 64).storage_dtype == torch.uint8
    assert resolve_kv_format("float16", torch.bfloat16, 64).storage_dtype == torch.float16
    with pytest.raises(PagecliError, match="multiple of 16"):
        resolve_kv_format("int8", torch.bfloat16, 40)
    with pytest.raises(PagecliError, match="kv-dtype"):
        resolve_kv_format("int4", torch.bfloat16, 64)


def test_fingerprint_name_keeps_the_old_name_for_auto():
    assert kv_fingerprint_name(torch.bfloat16, "none", KVFormat("bfloat16", 64)) == "bfloat16"
    # int8 weights with a scale per 64-block: another name than per-channel int8's "bfloat16+int8",
    # so a store written by the earlier int8 does not hit
    assert kv_fingerprint_name(torch.bfloat16, "int8", KVFormat("bfloat16", 64)) == "bfloat16+int8-b64"
    assert kv_fingerprint_name(torch.bfloat16, "int4", KVFormat("bfloat16", 64)) == "bfloat16+int4"
    assert kv_fingerprint_name(torch.bfloat16, "none", KVFormat("int8", 64)) == "bfloat16/kv-int8"
    # a float32 model's 4-bit products on the VNNI wide tiles: KV bytes of another rounding than the AVX2 kernel's
    assert kv_fingerprint_name(torch.float32, "gguf", KVFormat("float32", 64), wide=True) == "float32+gguf/a32639"
    assert kv_fingerprint_name(torch.float32, "gguf", KVFormat("float32", 64)) == "float32+gguf"


def test_engine_config_refuses_an_unknown_kv_dtype():
    with pytest.raises(PagecliError, match="kv_dtype must be one of"):
        EngineConfig(kv_dtype="int4")


# --- the engine ------------------------------------------------------------------------------------

def kv_engine(folder, kv_dtype: str, **config) -> Engine:
    settings = {"dtype": "float32", "disk_cache": False, "block_size": 4, "kv_dtype": kv_dtype, "threads": 1,
                **config}
    return Engine(str(folder), EngineConfig(**settings))


def test_the_same_budget_holds_about_twice_the_tokens_and_admits_that_many_more_sequences(tiny_model_factory):
    # head_dim 64, one kv head, 2 layers: a bfloat16 block of 16 tokens is 8,192 bytes, an int8 one 4,224
    folder = tiny_model_factory("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    budget = 24 * 8192 / (1 << 30)  # 24 bfloat16 blocks, 46 int8 ones (1.92x: twice, less the scales)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(15)]
    sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # 48 tokens: 3 blocks each
    runs = {}
    for kv in ("bfloat16", "int8"):
        with kv_engine(folder, kv, dtype="bfloat16", block_size=16, kv_budget_gib=budget,
                       enable_prefix_caching=False) as engine:
            outputs = engine.generate(prompts, sampling)
            runs[kv] = (engine.stats(), outputs)
    bf16, int8 = runs["bfloat16"][0], runs["int8"][0]
    assert (bf16.num_blocks, bf16.kv_bytes_per_block) == (24, 8192)
    assert (int8.num_blocks, int8.kv_bytes_per_block) == (46, 4224)
    assert bf16.kv_dtype == "bfloat16" and int8.kv_dtype == "int8"
    assert bf16.num_preemptions > 0, "15 sequences of 3 blocks were meant not to fit 24 bfloat16 blocks (8 do)"
    assert int8.num_preemptions == 0
    assert all(len(o.token_ids) == 40 for o in runs["int8"][1])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norms
def test_quantized_kv_greedy_output_does_not_depend_on_batching_chunking_preemption_or_prefix_hits(
        tiny_model_factory, arch, kv_dtype):
    # head size 32 for both: prompts over a quantized cache then go through pagecli's decode kernel a
    # row per token where it is built (at 16 they take PyTorch's SDPA, whose bits depend on the chunk)
    folder = tiny_model_factory(arch, head_dim=32)
    with kv_engine(folder, kv_dtype) as engine:
        assert format_of_cache(engine.runner.kv_caches) == kv_dtype
        alone = [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
        together = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]  # prefix hits from the runs alone
        assert engine.stats().prefix_hit_tokens > 0
    with kv_engine(folder, kv_dtype, max_num_batched_tokens=3) as engine:
        chunked = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    with kv_engine(folder, kv_dtype, num_blocks=14, enable_prefix_caching=False) as engine:
        preempted = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
        assert engine.stats().num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    assert together == alone and chunked == alone and preempted == alone


def test_quantized_blocks_come_back_from_the_disk_store_and_never_serve_another_format(tiny_model_factory,
                                                                                      tmp_path):
    folder = tiny_model_factory("llama")
    store = {"disk_cache": True, "disk_cache_dir": str(tmp_path / "store"), "disk_cache_all_prompts": True}
    prompt = [list(range(3, 43))]  # 40 tokens: 10 full blocks of 4
    with kv_engine(folder, "int8", **store) as engine:
        first = engine.generate(prompt, GREEDY)[0].token_ids
    with kv_engine(folder, "float32", **store) as engine:  # the model's own dtype: another fingerprint
        engine.generate(prompt, GREEDY)
        assert engine.stats().prefix_disk_hit_tokens == 0
    with kv_engine(folder, "int8", **store) as engine:
        again = engine.generate(prompt, GREEDY)[0].token_ids
        assert engine.stats().prefix_disk_hit_tokens >= 36
    assert again == first


def test_kv_in_another_float_dtype_than_the_model(tiny_model_factory):
    folder = tiny_model_factory("llama")
    with kv_engine(folder, "bfloat16") as engine:
        assert engine.runner.kv_caches.dtype == torch.bfloat16 and engine.loaded.dtype == torch.float32
        outputs = engine.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == 16 for o in outputs)


# --- where it is asked for ---------------------------------------------------------------------------

def test_a_bad_kv_dtype_on_the_command_line_is_one_sentence(tiny_llama, tmp_path, capsys):
    from pagecli.cli import main

    prompts = tmp_path / "in.txt"
    prompts.write_text("hello\n", encoding="utf-8")
    code = main(["generate", str(prompts), "-m", str(tiny_llama), "-o", str(tmp_path / "out.jsonl"),
                 "--kv-dtype", "int4", "--threads", "1"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert "kv_dtype must be one of auto, bfloat16, float16, float32, int8, fp8 (got 'int4')" in err


def test_a_profile_sets_the_kv_dtype(tmp_path):
    from pagecli.config import load_profile

    path = tmp_path / "p.toml"
    path.write_text('[engine]\nkv_dtype = "fp8"\n', encoding="utf-8")
    assert load_profile(str(path)).engine_config().kv_dtype == "fp8"


def test_bench_memory_adds_columns_for_a_kv_dtype(tiny_llama, tmp_path, capsys):
    import json

    from test_bench import assert_matches_doc

    from pagecli.cli import main

    out = tmp_path / "m.json"
    code = main(["bench", "memory", "-m", str(tiny_llama), "--dtype", "bfloat16", "--kv-dtype", "int8",
                 "--lengths", "100,300", "--budget", "1MiB", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "b16 int8" in text
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert_matches_doc(doc, "pagecli.bench.memory/1")  # docs/bench-json.md describes the kv_dtype object
    # 2 layers x 2 kv heads x 2 (K, V): 16 x 2 bytes in bfloat16, 16 + 2 in int8
    assert doc["inputs"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert doc["kv_dtype"]["kv_bytes_per_token"] == 2 * 2 * 2 * 18
    assert doc["kv_dtype"]["paged"][0]["requests_fit"] > doc["paged"][0]["requests_fit"]


def test_bench_memory_kv_dtype_needs_a_model(capsys):
    from pagecli.cli import main

    code = main(["bench", "memory", "--lengths", "100", "--kv-dtype", "int8", "--kv-bytes-per-token", "100"])
    assert code != 0 and "--kv-dtype needs --model" in capsys.readouterr().err


@pytest.mark.slow
def test_int8_kv_perplexity_on_smollm2_is_within_half_a_percent(smollm2_dir):
    """Issue 18's accuracy target, on the shipped text, against float32 (a bfloat16 model's own perplexity differs
    from float32's by about 1% on these 765 tokens, more than the target: docs/BENCHMARKS.md has both, and fp8's)."""
    from pathlib import Path

    from pagecli.bench.perplexity import perplexity

    text = (Path(__file__).parent / "data" / "declaration.txt").read_text(encoding="utf-8")
    ppl = {}
    for kv in ("auto", "int8"):
        config = EngineConfig(kv_dtype=kv, dtype="float32", disk_cache=False, threads=2)
        with Engine(str(smollm2_dir), config) as engine:
            ppl[kv] = perplexity(engine, text, 512).ppl
    assert abs(ppl["int8"] / ppl["auto"] - 1) <= 0.005, ppl


@pytest.mark.slow
def test_int8_kv_greedy_output_parts_from_float32_only_at_near_ties(smollm2_dir, smollm2_hf_dir):
    """Issue 18's greedy target, on test_smollm2_end_to_end's 9 requests, 24 tokens each, with float32 weights
    (a bfloat16 model parts from float32 on 5 of them by its own rounding: docs/benchmarks/kv-cache-quantized.md).
    Where int8's output parts from the float32 cache's, transformers' float32 logits at that token must put the
    two tokens within 0.1 of each other: the int8 cache may settle a near-tie the other way, never a clear choice.
    Measured 2026-11-26 (Zen 4, avx512): 7 of 9 identical; the other two part at their first token, where
    float32's top two logits are 0.018 and 0.038 apart. 2026-11-28 (Xeon with AMX, amx level): 5 of 9
    identical; the four others part where the top two are 0.022-0.052 apart (tokens 0, 2, 6 and 17): the
    count bound allows four, the margin check is the target."""
    from test_smollm2_end_to_end import REQUESTS
    from transformers import AutoModelForCausalLM

    def outputs(kv_dtype):
        config = EngineConfig(kv_dtype=kv_dtype, dtype="float32", disk_cache=False, threads=2)
        with Engine(str(smollm2_dir), config) as engine:
            prompts = [engine.encode_chat(r["messages"]) if "messages" in r else engine.encode(r["prompt"])
                       for r in REQUESTS]
            runs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            return prompts, [o.token_ids for o in runs]

    prompts, base = outputs("auto")
    _, int8 = outputs("int8")
    parted = [(p, a, b) for p, a, b in zip(prompts, base, int8) if a != b]
    assert len(parted) <= 4, f"{len(parted)} of {len(base)} requests parted"
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_hf_dir), dtype=torch.float32)
    for prompt, a, b in parted:
        at = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.no_grad():
            logits = model(torch.tensor([list(prompt) + list(a[:at])])).logits[0, -1]
        margin = float(logits[a[at]] - logits[b[at]])
        assert 0 <= margin < 0.1, (at, margin)
