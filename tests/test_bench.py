"""`pagecli bench`: the analytic memory model against hand-computed cases, and measured runs on tiny models."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import pagecli.cli.bench  # noqa: F401 - registers `bench` on the app
from pagecli.bench.lengths import parse_lengths
from pagecli.bench.memory import memory_report, paged_requests_fit
from pagecli.bench.summary import percentile
from pagecli.bench.units import format_bytes, parse_size
from pagecli.bench.workloads import BUILTIN_WORKLOADS, SHARED_SYSTEM_SENTENCES, builtin_workload, conversation_prompt
from pagecli.cli.app import app
from pagecli.config import SamplingParams
from pagecli.errors import PagecliError
from pagecli.ui.report import sparkline

DOC = Path(__file__).resolve().parents[1] / "docs" / "bench-json.md"
GREEDY = SamplingParams(temperature=0.0)
# A small engine for tiny models: enough blocks for every built-in prompt, little memory to allocate.
TINY_ENGINE = ["--num-blocks", "512", "--max-num-seqs", "8", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_long_llama(tiny_model_factory) -> Path:
    """A tiny llama whose context holds the built-in workloads' longest prompts (its tokenizer is byte-level-ish)."""
    return tiny_model_factory("llama", max_position_embeddings=4096)


def invoke(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


# --- sizes ---------------------------------------------------------------------------------------


def test_sizes_parse_binary_si_and_plain_bytes():
    assert parse_size("8GiB") == 8 * 1024**3
    assert parse_size("8G") == parse_size("8gi") == 8 * 1024**3
    assert parse_size("500MB") == 500_000_000
    assert parse_size("1.5 KiB") == 1536
    assert parse_size("4096") == 4096
    assert format_bytes(737280) == "720 KiB" and format_bytes(8 * 1024**3) == "8.00 GiB" and format_bytes(12) == "12 B"


@pytest.mark.parametrize("text", ["", "eight GiB", "8 parsecs", "-1GiB", "1.2.3MB"])
def test_sizes_that_are_not_sizes_are_refused_with_an_example(text):
    with pytest.raises(PagecliError, match="8GiB"):
        parse_size(text)


# --- the analytic model --------------------------------------------------------------------------


def test_memory_hand_example_800_2300_3900_at_4096_block_16():
    report = memory_report([800, 2300, 3900], max_len=4096, block_sizes=[16])
    contiguous, paged = report.contiguous, report.paged[0]
    assert contiguous.reserved_slots == 3 * 4096
    assert contiguous.wasted_slots == (4096 - 800) + (4096 - 2300) + (4096 - 3900) == 5288
    assert [r.paged_allocated_slots for r in paged.requests] == [800, 2304, 3904]
    assert [r.paged_wasted_slots for r in paged.requests] == [0, 4, 4]
    assert [r.paged_blocks for r in paged.requests] == [50, 144, 244]
    assert paged.allocated_slots == 7008 and paged.wasted_slots == 8 and paged.blocks == 438
    assert paged.waste_bound_slots == 3 * 15
    assert paged.waste_share == pytest.approx(8 / 7008)
    assert contiguous.waste_share == pytest.approx(5288 / 12288)
    assert contiguous.reserved_bytes is None and paged.allocated_bytes is None  # no KV size: slots only


def test_memory_exact_multiples_and_single_tokens_across_block_sizes():
    lengths = [1, 16, 17, 32]
    report = memory_report(lengths, max_len=64, block_sizes=[1, 16, 32])
    by_size = {p.block_size: p for p in report.paged}
    assert report.contiguous.reserved_slots == 256
    assert report.contiguous.wasted_slots == 63 + 48 + 47 + 32
    # Block size 1: paging holds exactly the tokens; the bound is zero.
    assert by_size[1].allocated_slots == 66 and by_size[1].wasted_slots == 0 and by_size[1].waste_bound_slots == 0
    # Block size 16: a length of 1 wastes 15, an exact multiple wastes nothing, 17 spills into a second block.
    assert [r.paged_wasted_slots for r in by_size[16].requests] == [15, 0, 15, 0]
    assert by_size[16].allocated_slots == 16 + 16 + 32 + 32
    assert by_size[16].waste_bound_slots == 4 * 15
    # Block size 32: every request fits one block.
    assert [r.paged_allocated_slots for r in by_size[32].requests] == [32, 32, 32, 32]
    assert by_size[32].wasted_slots == 31 + 16 + 15 + 0


def test_memory_max_len_only_changes_the_contiguous_side():
    short, long = (memory_report([100, 200], max_len=m, block_sizes=[16]) for m in (256, 8192))
    assert short.contiguous.reserved_slots == 512 and long.contiguous.reserved_slots == 16384
    assert short.contiguous.wasted_slots == 156 + 56 and long.contiguous.wasted_slots == 8092 + 7992
    assert short.paged[0].allocated_slots == long.paged[0].allocated_slots == 112 + 208


def test_paging_never_wastes_more_than_block_size_minus_one_per_request():
    rng = random.Random(7)
    for block_size in (1, 3, 16, 128):
        lengths = [rng.randint(1, 5000) for _ in range(200)]
        paged = memory_report(lengths, max_len=5000, block_sizes=[block_size]).paged[0]
        assert all(0 <= r.paged_wasted_slots <= block_size - 1 for r in paged.requests)
        assert paged.wasted_slots <= paged.waste_bound_slots


def test_shared_prefix_is_stored_once_in_whole_blocks_only():
    report = memory_report([1600, 1700, 2000], max_len=4096, block_sizes=[16], shared_prefix_tokens=1500,
                           kv_bytes_per_token=100)
    paged = report.paged[0]
    assert paged.shared_prefix_blocks == 93  # 1500 // 16: the prefix's last 12 tokens share a block with the request
    assert paged.blocks == 100 + 107 + 125
    assert paged.blocks_saved_by_sharing == 2 * 93
    assert paged.blocks_with_sharing == 332 - 186
    assert paged.kv_bytes_per_block == 1600
    assert paged.allocated_bytes == 332 * 1600 and paged.bytes_with_sharing == 146 * 1600


def test_requests_that_fit_a_budget_under_each_scheme():
    # 1000 bytes per token, 10 MB: contiguous holds 10e6 // (4096 * 1000) = 2 requests.
    report = memory_report([800, 2300, 3900], max_len=4096, block_sizes=[16], kv_bytes_per_token=1000,
                           budget_bytes=10_000_000)
    assert report.contiguous.requests_fit == 2
    assert report.contiguous.reserved_bytes == 12288 * 1000
    # Paged: 625 blocks of 16 KB; the mix needs 50 + 144 + 244 = 438, then 50 more fit and 144 do not.
    assert report.paged[0].requests_fit == 4
    # With a 1500-token shared prefix, its 93 blocks are stored once; each request needs only its own blocks.
    assert paged_requests_fit([1600], block_size=16, pool_blocks=100, shared_prefix_tokens=1500) == 1  # 93 + 7
    assert paged_requests_fit([1600], block_size=16, pool_blocks=92, shared_prefix_tokens=1500) == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(lengths=[5000], max_len=4096), "does not fit --max-len 4096"),
    (dict(lengths=[0, 5], max_len=64), "at least 1 token"),
    (dict(lengths=[100], max_len=4096, budget_bytes=10**9), "needs the KV size"),
    (dict(lengths=[100, 200], max_len=4096, shared_prefix_tokens=100), "longer than the shared prefix"),
    (dict(lengths=[100], max_len=4096, block_sizes=[0]), "block size"),
])
def test_memory_inputs_that_describe_no_requests_are_refused(kwargs, message):
    kwargs.setdefault("block_sizes", [16])
    with pytest.raises(PagecliError, match=message):
        memory_report(**kwargs)


def test_lengths_come_from_a_list_a_file_or_a_seeded_distribution(tmp_path):
    assert parse_lengths("800, 2300,3900", 0, 0, 4096) == (800, 2300, 3900)
    lengths_file = tmp_path / "lengths.txt"
    lengths_file.write_text("# from the logs\n120 340\n560,\n")
    assert parse_lengths(str(lengths_file), 0, 0, 4096) == (120, 340, 560)
    drawn = parse_lengths("uniform:20-4000", 100, 0, 4096)
    assert len(drawn) == 100 and all(20 <= n <= 4000 for n in drawn)
    assert drawn == parse_lengths("uniform:20-4000", 100, 0, 4096)
    assert drawn != parse_lengths("uniform:20-4000", 100, 1, 4096)
    assert all(1 <= n <= 512 for n in parse_lengths("lognormal:300,1.5", 50, 0, 512))
    with pytest.raises(PagecliError, match="whole number"):
        parse_lengths("800,lots", 0, 0, 4096)


def test_a_long_tailed_distribution_is_clipped_to_max_len_instead_of_overflowing():
    drawn = parse_lengths("lognormal:100,1000", 200, 0, 4096)  # e**(1000 sigma) is past any float
    assert all(1 <= n <= 4096 for n in drawn) and {1, 4096} <= set(drawn)
    assert drawn == parse_lengths("lognormal:100,1000", 200, 0, 4096)


def test_lengths_drawn_in_log_space_are_the_ones_a_seed_always_gave():
    rng = random.Random(0)
    before = tuple(min(max(round(rng.lognormvariate(math.log(300), 1.5)), 1), 512) for _ in range(50))
    assert parse_lengths("lognormal:300,1.5", 50, 0, 512) == before


BAD_MEMORY_FLAGS = {  # id: (flags, what the one line says)
    "an unknown dtype": (["--dtype", "int4"], "--dtype must be one of auto, float32, bfloat16, float16 (got 'int4')"),
    "an unknown dtype with a model": (["--dtype", "int4", "-m", "{tiny}"], "--dtype must be one of"),
    "max-len 0": (["--max-len", "0"], "--max-len must be at least 1 (got 0)"),
    "max-len 0 with a model": (["--max-len", "0", "-m", "{tiny}"], "--max-len must be at least 1 (got 0)"),
    "uniform from 0": (["-l", "uniform:0-0"], "lower bound of 0 tokens; request lengths must be at least 1"),
    "normal below one token": (["-l", "normal:0.5,3"], "mean of 0.5 tokens"),
    "lognormal below one token": (["-l", "lognormal:0.2,1"], "median of 0.2 tokens"),
    "a mean past any float": (["-l", "normal:1" + "0" * 400 + ",5"], "has a number too large to use"),
    "count 0": (["--count", "0"], "--count must be between 1 and 1,000,000"),
    "a budget past an exbibyte": (["--budget", "9" * 40 + "GiB", "--kv-bytes-per-token", "8"], "more than 1 EiB"),
    "KV bytes past an exbibyte": (["--kv-bytes-per-token", "1" + "0" * 40], "KV bytes per token must be between"),
    "a block size past any context": (["-b", "1" + "0" * 40], "Every block size must be between"),
    "a list too long for a file name": (["-l", "5," * 200 + "5", "--max-len", "10"], None),
}


@pytest.mark.parametrize("case", [case for case, flags in BAD_MEMORY_FLAGS.items() if flags])
def test_bench_memory_flags_that_describe_no_report_are_one_sentence(case, tiny_llama, capsys):
    from pagecli.cli import main

    flags, fragment = BAD_MEMORY_FLAGS[case]
    code = main(["bench", "memory", *(flag.format(tiny=tiny_llama) for flag in flags)])
    err = capsys.readouterr().err
    if fragment is None:  # a valid request: a report, not a traceback
        assert code == 0, err
        return
    lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert code == 2 and len(lines) == 1 and "Unexpected" not in err, err
    assert fragment in lines[0], lines[0]


def test_bench_memory_with_a_huge_lognormal_sigma_reports(capsys):
    from pagecli.cli import main

    assert main(["bench", "memory", "-l", "lognormal:100,1000", "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert max(document["inputs"]["lengths"]) == 4096


# --- workloads and summaries -----------------------------------------------------------------------


def test_builtin_workloads_are_deterministic_and_sized_as_documented():
    for name, shape in BUILTIN_WORKLOADS.items():
        workload = builtin_workload(name, GREEDY, seed=3)
        assert workload == builtin_workload(name, GREEDY, seed=3)
        assert workload != builtin_workload(name, GREEDY, seed=4)
        assert len(workload.requests) == shape.default_count
        assert all(r.sampling.ignore_eos and r.sampling.temperature == 0 for r in workload.requests)
    assert len(builtin_workload("mixed", GREEDY).requests) == 64
    small = builtin_workload("mixed", GREEDY, count=5, max_tokens=3)
    assert len(small.requests) == 5 and {r.sampling.max_tokens for r in small.requests} == {3}
    prompts = [r.prompt for r in builtin_workload("shared-prefix", GREEDY).requests]
    assert len({p[0]["content"] for p in prompts}) == 1 and len({p[1]["content"] for p in prompts}) > 1
    text = builtin_workload("mixed", GREEDY).requests[0].prompt
    assert re.fullmatch(r"[A-Za-z ,.?\n]+", text)  # plain words, not random token ids


def test_shared_prefix_system_sentences_lengthen_the_one_system_prompt():
    default = builtin_workload("shared-prefix", GREEDY, seed=2)
    assert default == builtin_workload("shared-prefix", GREEDY, seed=2, system_sentences=SHARED_SYSTEM_SENTENCES)
    longer = builtin_workload("shared-prefix", GREEDY, seed=2, system_sentences=3 * SHARED_SYSTEM_SENTENCES)
    systems = {r.prompt[0]["content"] for r in longer.requests}
    assert len(systems) == 1 and len(longer.requests) == len(default.requests)
    (system,) = systems
    assert system.startswith(default.requests[0].prompt[0]["content"])
    assert system.count(". ") + 1 == 3 * SHARED_SYSTEM_SENTENCES
    with pytest.raises(PagecliError, match="at least 1 sentence"):
        builtin_workload("shared-prefix", GREEDY, system_sentences=0)


def test_a_conversation_turn_resends_the_history_with_earlier_replies():
    chat = builtin_workload("chat", GREEDY, count=3)
    assert chat.conversation
    messages = conversation_prompt(chat, 2, ["first reply", "second reply"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[2]["content"] == "first reply" and messages[-1] == dict(chat.requests[2].prompt[0])


def test_percentiles_interpolate_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0 and percentile([], 50) is None


def test_sparkline_scales_to_the_given_top_and_fits_the_width():
    assert sparkline([0, 5, 10], top=10) == "▁▅█"
    assert sparkline([0, 0], top=10) == "▁▁"
    assert len(sparkline(list(range(1000)), width=40)) == 40


# --- the JSON schema (docs/bench-json.md is the reference) --------------------------------------------


def documented_fields(schema: str) -> dict[str, set[str]]:
    """path -> allowed JSON types, from the field table under the schema's heading in docs/bench-json.md."""
    section = DOC.read_text().split(f"## `{schema}`", 1)[1].split("\n## ", 1)[0]
    fields: dict[str, set[str]] = {}
    for path, kind in re.findall(r"^\| `([^`]+)` \| ([^|]+(?:\\\|[^|]+)?) \|", section, re.MULTILINE):
        types = {t.strip() for t in kind.replace("\\|", "|").split("|")}
        for t in types:
            if t.endswith("[]"):
                fields.setdefault(path, set()).add("array")
                fields.setdefault(f"{path}[]", set()).add(t[:-2])
            else:
                fields.setdefault(path, set()).add(t)
    return fields


_JSON_TYPES = {"integer": int, "number": (int, float), "string": str, "boolean": bool, "object": dict,
               "array": list, "null": type(None)}


def assert_matches_doc(document: dict, schema: str) -> None:
    fields = documented_fields(schema)
    assert document["schema"] == schema
    seen: set[str] = set()
    cut: list[str] = []  # paths that were null or empty arrays: their children need not appear

    def walk(value: object, path: str) -> None:
        assert path in fields, f"'{path}' is not documented in {DOC.name}"
        seen.add(path)
        ok = any(isinstance(value, _JSON_TYPES[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                 for t in fields[path])
        assert ok, f"'{path}' is {value!r}, documented as {fields[path]}"
        child = f"{path}." if path else ""
        opaque = not any(p != path and (p.startswith(child) or p.startswith(path + "[]")) for p in fields)
        if value is None or value == [] or opaque:
            cut.append(path)
        elif isinstance(value, dict):
            for key, child in value.items():
                walk(child, f"{path}.{key}" if path else key)
        elif isinstance(value, list):
            for child in value:
                walk(child, f"{path}[]")

    fields[""] = {"object"}
    walk(document, "")
    missing = [p for p in fields if p not in seen and not any(p.startswith(c + ".") or p.startswith(c + "[]")
                                                               for c in cut)]
    assert not missing, f"documented but not written: {missing}"


def test_bench_memory_cli_prints_tables_and_json_that_match_the_doc(tmp_path, tiny_llama):
    out = tmp_path / "memory.json"
    text = invoke("bench", "memory", "--lengths", "800,2300,3900", "--max-len", "4096", "-b", "8,16",
                  "--model", str(tiny_llama), "--dtype", "float32", "--budget", "8MiB", "--shared-prefix", "700",
                  "--json", str(out))
    assert "512 KV bytes per token" in text  # 2 layers x 2 KV heads x 16 head dim x 2 x 4 bytes
    assert "12,288" in text and "7,008" in text
    document = json.loads(out.read_text())
    assert_matches_doc(document, "pagecli.bench.memory/1")
    assert document["inputs"]["kv_bytes_per_token"] == 512
    assert document["contiguous"]["requests_fit"] == 4  # 8 MiB / (4096 slots x 512 bytes)
    assert [p["waste_bound_slots"] for p in document["paged"]] == [21, 45]


def test_bench_memory_without_a_model_counts_slots_only():
    text = invoke("bench", "memory", "--lengths", "uniform:20-4000", "--count", "30", "--seed", "1")
    assert "No model named" in text and "30 requests" in text
    with pytest.raises(PagecliError, match="needs the KV size"):
        CliRunner().invoke(app, ["bench", "memory", "--budget", "1GiB"], catch_exceptions=False)


# --- measured runs ---------------------------------------------------------------------------------


def run_json(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "run.json"
    text = invoke("bench", "run", *args, "--json", str(out), *TINY_ENGINE)
    return json.loads(out.read_text()), text


def assert_figures_come_from_the_snapshot(document: dict) -> None:
    engine, timeline = document["engine"], document["timeline"]
    before, after = document["engine_stats"]["before"], document["engine_stats"]["after"]
    assert engine["kv_bytes_total"] == engine["num_blocks"] * engine["kv_bytes_per_block"]
    assert engine["kv_bytes_per_block"] == engine["kv_bytes_per_token"] * engine["block_size"]
    blocks, memory = document["blocks"], document["memory"]
    assert memory["kv_bytes_active_peak"] == blocks["active"]["peak"] * engine["kv_bytes_per_block"]
    for active, cached, free in zip(timeline["active"], timeline["cached"], timeline["free"]):
        assert active + cached + free == engine["num_blocks"]
    for unused, running in zip(timeline["slots_unused"], timeline["running"]):
        assert 0 <= unused <= running * (engine["block_size"] - 1)
    prefix = document["prefix"]
    for ours, theirs in (("query_tokens", "prefix_query_tokens"), ("hit_tokens", "prefix_hit_tokens"),
                         ("disk_hit_tokens", "prefix_disk_hit_tokens")):
        assert prefix[ours] == after[theirs] - before[theirs]
    assert document["preemptions"] == after["num_preemptions"] - before["num_preemptions"]
    assert document["workload"]["output_tokens"] == sum(r["output_tokens"] for r in document["requests"])
    contiguous = memory["contiguous"]
    assert contiguous["peak_concurrency"] == max(timeline["running"])
    per_sequence_bytes = engine["max_model_len"] * engine["kv_bytes_per_token"]
    assert contiguous["kv_bytes"] == contiguous["peak_concurrency"] * per_sequence_bytes


def test_bench_run_mixed_reports_pool_memory_and_speed_from_engine_stats(tmp_path, tiny_long_llama):
    document, text = run_json(tmp_path, "mixed", "-m", str(tiny_long_llama), "--count", "6", "-n", "4")
    assert_matches_doc(document, "pagecli.bench.run/1")
    assert_figures_come_from_the_snapshot(document)
    assert (document["workload"]["num_requests"], document["workload"]["output_tokens"]) == (6, 24)
    assert document["throughput"]["ttft_p50_s"] > 0 and document["throughput"]["output_tokens_per_s"] > 0
    assert document["compare"] is None
    assert "contiguous reservation would need" in text and "TTFT p95" in text


def test_bench_run_shared_prefix_hits_the_cache_and_shares_blocks(tmp_path, tiny_long_llama):
    document, text = run_json(tmp_path, "shared-prefix", "-m", str(tiny_long_llama), "--count", "3", "-n", "2")
    assert_figures_come_from_the_snapshot(document)
    assert document["prefix"]["hit_tokens"] > 0 and document["prefix"]["hit_rate"] > 0.5
    assert document["prefix"]["blocks_saved_by_sharing_peak"] > 0 and document["blocks"]["shared_peak"] > 0
    assert sum(r["cached_tokens"] for r in document["requests"]) > 0


def test_bench_run_chat_turns_reuse_the_history_from_the_cache(tmp_path, tiny_long_llama):
    document, _ = run_json(tmp_path, "chat", "-m", str(tiny_long_llama), "--count", "3", "-n", "3")
    turns = document["requests"]
    assert [t["id"] for t in turns] == ["chat-turn-1", "chat-turn-2", "chat-turn-3"]
    assert turns[0]["cached_tokens"] == 0 and all(t["cached_tokens"] > 0 for t in turns[1:])
    assert turns[2]["prompt_tokens"] > turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"]


def test_bench_run_takes_a_generate_jsonl_file(tmp_path, tiny_llama):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"id": "a", "prompt": "The quick brown fox", "max_tokens": 3}\n'
                        '{"id": "b", "messages": [{"role": "user", "content": "Hello world"}]}\n')
    document, _ = run_json(tmp_path, str(requests), "-m", str(tiny_llama), "-n", "2", "--no-warmup")
    assert sorted(r["id"] for r in document["requests"]) == ["a", "b"]
    assert all(1 <= r["output_tokens"] <= 2 for r in document["requests"])  # --max-tokens beats the line's 3
    assert document["workload"]["name"] == str(requests)


def test_compare_hf_runs_transformers_on_the_same_requests_and_outputs_agree(tmp_path, tiny_long_llama):
    document, text = run_json(tmp_path, "mixed", "-m", str(tiny_long_llama), "--count", "3", "-n", "5",
                              "--compare", "hf", "--hf-batch-size", "2", "--dtype", "float32")
    compare = document["compare"]
    assert_matches_doc(document, "pagecli.bench.run/1")
    assert compare["agreement"] == {"num_requests": 3, "num_identical": 3, "all_identical": True, "differences": []}
    assert compare["hf"]["output_tokens"] == document["workload"]["output_tokens"] == 15
    assert compare["hf"]["batch_size"] == 2 and compare["ratios"]["output_tokens_per_s"] > 0
    assert "Greedy outputs agree: 3 of 3 identical" in text


def test_compare_hf_starts_transformers_after_the_engine_and_its_kv_pool_are_released(
        tmp_path, tiny_llama, monkeypatch, engines_checked_after_test):
    """On a GPU the engine's KV pool takes most of the memory: a live engine left transformers none (CUDA out of
    memory at SmolLM2-1.7B's shape on an H100). So no Engine may be alive when the comparison starts."""
    import gc
    import weakref

    from pagecli.bench import compare_hf

    watched = engines_checked_after_test.engines  # conftest holds every engine for its pool check at teardown

    def fake_run(job, timeout_s=None):
        engines = [weakref.ref(e) for e in watched]
        watched.clear()  # only this test's weak references remain
        gc.collect()
        assert engines and not any(ref() for ref in engines), "the engine is still alive while transformers runs"
        outputs = {r.request_id: () for r in job.requests}
        return compare_hf.HFResult(outputs=outputs, ttft_s={}, elapsed_s=1.0, peak_rss_bytes=0, peak_gpu_bytes=None,
                                   batch_size=job.batch_size, transformers_version="fake")

    monkeypatch.setattr(compare_hf, "run_in_subprocess", fake_run)
    document, _ = run_json(tmp_path, "mixed", "-m", str(tiny_llama), "--count", "2", "-n", "2", "--compare", "hf")
    assert document["compare"]["agreement"]["num_requests"] == 2


def test_compare_hf_refuses_sampled_decoding(tiny_llama):
    with pytest.raises(PagecliError, match="greedy"):
        CliRunner().invoke(app, ["bench", "run", "mixed", "-m", str(tiny_llama), "--compare", "hf",
                                 "--temperature", "0.8"], catch_exceptions=False)


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tiny_llama):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    with pytest.raises(PagecliError, match=re.escape("pip install 'pagecli[plot]'")):
        CliRunner().invoke(app, ["bench", "run", "-m", str(tiny_llama), "--plot", "pool.png"], catch_exceptions=False)


def test_plot_draws_the_timeline_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    from pagecli.bench.plot import plot_occupancy

    target = tmp_path / "pool.png"
    plot_occupancy(str(target), [0.0, 0.5, 1.0], [0, 6, 2], [0, 1, 4], [10, 3, 4], "test")
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_workload_names_the_built_in_ones(tiny_llama):
    with pytest.raises(PagecliError, match="mixed, shared-prefix, chat"):
        CliRunner().invoke(app, ["bench", "run", "nonsense", "-m", str(tiny_llama)], catch_exceptions=False)


# --- the embedded model ----------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_run_on_the_embedded_model(tmp_path, smollm2_dir):
    # A small step budget: later requests arrive after the system prompt's blocks are committed, so they hit.
    document, _ = run_json(tmp_path, "shared-prefix", "-m", str(smollm2_dir), "--count", "3", "-n", "2",
                           "--max-num-batched-tokens", "256", "--dtype", "float32")
    assert_matches_doc(document, "pagecli.bench.run/1")
    assert_figures_come_from_the_snapshot(document)
    assert document["engine"]["kv_bytes_per_token"] == 30 * 3 * 64 * 2 * 4  # SmolLM2-135M in float32
    assert document["prefix"]["hit_tokens"] > 0


@pytest.mark.slow
def test_bench_memory_reads_the_embedded_models_config_without_running_it():
    text = invoke("bench", "memory", "--model", "default", "--lengths", "800,2300,3900", "--max-len", "4096",
                  "--budget", "8GiB", "--dtype", "float32")
    assert "46,080 KV bytes per token" in text  # 30 layers x 3 KV heads x 64 x 2 x 4 bytes


def test_bench_run_says_which_sampling_it_ran():
    from pagecli.cli.bench import sampling_description
    from pagecli.config import SamplingParams

    assert sampling_description([SamplingParams(temperature=0)] * 2) == "greedy"
    assert sampling_description([SamplingParams(temperature=0.7, top_p=0.95)]) == "temperature 0.7, top_p 0.95"
    assert sampling_description([SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=40)]) == \
        "mixed: greedy; temperature 1, top_k 40"
