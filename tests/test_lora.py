"""LoRA adapters: greedy output equals PEFT's on every architecture, a mixed batch gives each request its
output alone, adapters never share prefix-cache blocks (pool or disk store), and a bad adapter is one sentence.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_probes import recorded_logits
from lora_helpers import ATTENTION, MLP, make_adapter, one_thread, peft_greedy  # noqa: F401 - a fixture
from pagecli import native
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.errors import ModelError, PagecliError, RequestError
from pagecli.models.loader import load_model
from native_levels import COMPILED_LEVELS
from tiny_models import ARCHS, MOE_ARCHS, NEW_ARCHS

TOKENS = 12
PROMPTS = ["Hello world! How are you", "Très bien, merci. 日本語", "def main():\n    print("]
LONG_PROMPT = "Paged attention keeps the KV cache in fixed-size blocks. " * 3 + "The quick brown fox"


def greedy(lora: str | None = None, max_tokens: int = TOKENS, scale: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora=lora, lora_scale=scale)


def engine_for(folder: Path, loras: dict[str, Path], **config) -> Engine:
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "num_blocks": 256, "block_size": 4,
                "disk_cache": False, "loras": tuple((name, str(path)) for name, path in loras.items()), **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))


@pytest.fixture(scope="module")
def llama_adapters(tiny_model_factory, tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """The tiny llama and four adapters of it: ranks 8 and 64, attention only, rsLoRA."""
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("adapters")
    return base, {
        "r8": make_adapter(base, root / "r8", rank=8, seed=1),
        "r64": make_adapter(base, root / "r64", rank=64, seed=2),
        "attn": make_adapter(base, root / "attn", rank=4, targets=ATTENTION, seed=3),
        "rs": make_adapter(base, root / "rs", rank=16, targets=["q_proj", "v_proj", *MLP], seed=4, rslora=True),
    }


# --- equal to PEFT -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["r8", "r64", "attn", "rs"])
def test_greedy_with_an_adapter_equals_peft(name, llama_adapters):
    base, adapters = llama_adapters
    engine = engine_for(base, adapters)
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        [out] = engine.generate([ids], greedy(name))
        assert list(out.token_ids) == peft_greedy(base, adapters[name], ids, TOKENS), prompt


@pytest.mark.parametrize("arch", [*ARCHS, *NEW_ARCHS])
def test_every_architecture_with_an_adapter_equals_peft(arch, tiny_model_factory, tmp_path):
    base = tiny_model_factory(arch)
    targets = ATTENTION if arch in MOE_ARCHS else None  # a mixture of experts takes adapters of its attention
    adapter = make_adapter(base, tmp_path / "adapter", rank=8, seed=5, b_scale=1.0, targets=targets)
    engine = engine_for(base, {"a": adapter})
    logits = recorded_logits(engine)
    ids = engine.encode(PROMPTS[0])
    [with_adapter] = engine.generate([ids], greedy("a", max_tokens=1))
    engine.generate([ids], greedy(max_tokens=1))
    assert (logits[0] - logits[1]).abs().max() > 1e-2, "the adapter should change this model's logits"
    [with_adapter] = engine.generate([ids], greedy("a"))
    assert list(with_adapter.token_ids) == peft_greedy(base, adapter, ids, TOKENS)


def test_the_embedded_model_with_adapters_of_rank_8_and_64_equals_peft(smollm2_dir, smollm2_hf_dir, tmp_path):
    adapters = {f"r{rank}": make_adapter(smollm2_dir, tmp_path / f"r{rank}", rank=rank, seed=rank, b_scale=0.05)
                for rank in (8, 64)}
    engine = engine_for(smollm2_dir, adapters, num_blocks=64, block_size=16)
    ids = engine.encode([{"role": "user", "content": "Name three colours."}])
    for name, folder in adapters.items():
        [out] = engine.generate([ids], greedy(name, max_tokens=8))
        assert list(out.token_ids) == peft_greedy(smollm2_hf_dir, folder, ids, 8), name


@pytest.mark.skipif(not COMPILED_LEVELS or not native.enabled(), reason="no compiled CPU kernels here")
@pytest.mark.parametrize("level", COMPILED_LEVELS)
def test_the_native_kernels_with_an_adapter_equal_peft(level, llama_adapters, monkeypatch):
    """pagecli.native's products (its one-call decode step stands aside for adapter rows) plus the adds."""
    monkeypatch.setattr(native, "_state", {"module": native.cpu_ops_for(level)})
    base, adapters = llama_adapters
    engine = engine_for(base, adapters, attention="auto")
    ids = engine.encode(PROMPTS[2])
    [out] = engine.generate([ids], greedy("r8"))
    assert list(out.token_ids) == peft_greedy(base, adapters["r8"], ids, TOKENS)


@pytest.mark.skipif(not COMPILED_LEVELS or not native.enabled(), reason="no compiled CPU kernels here")
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_base_weights_with_an_adapter_match_the_adapter_on_the_same_weights(quantize, llama_adapters):
    """On quantized base products the adapter adds the same low-rank rows: the batch equals each request alone."""
    base, adapters = llama_adapters
    engine = engine_for(base, adapters, attention="auto", quantize=quantize)
    ids = engine.encode(PROMPTS[0])
    alone = [engine.generate([ids], greedy(name))[0].token_ids for name in ("r8", None)]
    together = [c.token_ids for c in _mixed(engine, [(ids, "r8"), (ids, None)])]
    assert together == alone
    assert alone[0] != alone[1]


# --- one batch, many adapters ----------------------------------------------------------------------------
def _mixed(engine: Engine, requests: list[tuple[list[int], str | None]], stagger: bool = False) -> list:
    """Every request in one engine; stagger: half of them join two steps later (prefills beside decodes)."""
    half = len(requests) // 2 if stagger else len(requests)
    ids = [engine.add_request(prompt, greedy(lora)) for prompt, lora in requests[:half]]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    events = [event for _ in range(2) for event in engine.step()] if stagger else []
    later = [engine.add_request(prompt, greedy(lora)) for prompt, lora in requests[half:]]
    ids += later
    tokens.update({i: [] for i in later})
    done = {}
    for event in [*events, *engine.stream()]:
        tokens[event.request_id].extend(event.token_ids)
        if event.finished:
            done[event.request_id] = tuple(tokens[event.request_id])
    return [type("Out", (), {"token_ids": done[i]}) for i in ids]


@pytest.mark.parametrize("stagger", [False, True])
def test_a_batch_mixing_four_adapters_and_the_base_gives_each_request_its_output_alone(stagger, llama_adapters):
    base, adapters = llama_adapters
    engine = engine_for(base, adapters)
    names = [*adapters, None]
    requests = [(engine.encode(prompt), name) for prompt in PROMPTS for name in names]
    alone = [engine.generate([ids], greedy(name))[0].token_ids for ids, name in requests]
    engine = engine_for(base, adapters, enable_prefix_caching=False)
    together = [out.token_ids for out in _mixed(engine, requests[::-1], stagger)][::-1]
    assert together == alone
    assert len({alone[i] for i in range(len(names))}) == len(names), "each adapter gives its own output"


def test_lora_scale_zero_is_the_base_model_and_a_scale_changes_the_output(llama_adapters):
    base, adapters = llama_adapters
    engine = engine_for(base, adapters)
    ids = engine.encode(PROMPTS[0])
    plain = engine.generate([ids], greedy())[0].token_ids
    assert engine.generate([ids], greedy("r8", scale=0.0))[0].token_ids == plain
    assert engine.generate([ids], greedy("r8", scale=1.0))[0].token_ids != plain


# --- the prefix cache, per adapter ------------------------------------------------------------------------
def test_one_prompt_under_two_adapters_shares_no_block(llama_adapters):
    base, adapters = llama_adapters
    engine = engine_for(base, adapters)
    ids = engine.encode(LONG_PROMPT)
    first = engine.generate([ids], greedy("r8", max_tokens=2))[0]
    assert first.cached_tokens == 0
    for other in ("r64", None):
        assert engine.generate([ids], greedy(other, max_tokens=2))[0].cached_tokens == 0, other
    again = engine.generate([ids], greedy("r8", max_tokens=2))[0]
    assert again.cached_tokens == (len(ids) - 1) // 4 * 4  # the same adapter does hit
    roots = {engine.kv.root_hash, engine.adapters.root_hash("r8"), engine.adapters.root_hash("r64")}
    assert len(roots) == 3


def test_the_disk_store_never_serves_one_adapters_blocks_to_another(llama_adapters, tmp_path):
    base, adapters = llama_adapters
    store = {"disk_cache": True, "disk_cache_dir": str(tmp_path / "store")}
    writer = engine_for(base, adapters, **store)
    ids = writer.encode(LONG_PROMPT)
    expected = writer.generate([ids], greedy("r8", max_tokens=4))[0].token_ids
    assert writer.persist_prefix(ids, "r8") == len(ids) // 4
    writer.close()
    for other in ("r64", None):
        reader = engine_for(base, adapters, **store)
        assert reader.generate([ids], greedy(other, max_tokens=2))[0].cached_tokens == 0, other
        assert reader.stats().prefix_disk_hit_tokens == 0
        reader.close()
    reader = engine_for(base, adapters, **store)
    out = reader.generate([ids], greedy("r8", max_tokens=4))[0]
    assert reader.stats().prefix_disk_hit_tokens == (len(ids) - 1) // 4 * 4
    assert out.token_ids == expected
    reader.close()


def test_a_changed_adapter_under_the_same_name_never_hits_its_old_blocks(llama_adapters, tmp_path):
    base, _ = llama_adapters
    folder = make_adapter(base, tmp_path / "a", rank=8, seed=10)
    store = {"disk_cache": True, "disk_cache_dir": str(tmp_path / "store")}
    writer = engine_for(base, {"a": folder}, **store)
    ids = writer.encode(LONG_PROMPT)
    writer.generate([ids], greedy("a", max_tokens=2))
    writer.persist_prefix(ids, "a")
    writer.close()
    make_adapter(base, folder, rank=8, seed=11)  # retrained: same name, same shapes, other weights
    reader = engine_for(base, {"a": folder}, **store)
    assert reader.generate([ids], greedy("a", max_tokens=2))[0].cached_tokens == 0
    reader.close()


# --- budget and bad adapters --------------------------------------------------------------------------
def test_adapters_load_on_first_use_and_the_budget_drops_the_least_recently_used_idle_one(llama_adapters):
    base, adapters = llama_adapters
    engine = engine_for(base, adapters, max_loras=2)
    assert not any(s.loaded for s in engine.adapters.summaries())
    ids = engine.encode(PROMPTS[0])
    for name in ("r8", "r64", "attn"):
        engine.generate([ids], greedy(name, max_tokens=1))
    assert {s.name for s in engine.adapters.summaries() if s.loaded} == {"r64", "attn"}
    engine.add_request(ids, greedy("r8"))
    engine.add_request(ids, greedy("r64"))
    with pytest.raises(RequestError, match="All 2 LoRA adapter slots are in use"):
        engine.add_request(ids, greedy("attn"))
    with pytest.raises(RequestError, match="No LoRA adapter named 'nope'"):
        engine.add_request(ids, greedy("nope"))


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_bad_adapters_are_one_sentence_at_start(llama_adapters, tiny_model_factory, tmp_path):
    base, adapters = llama_adapters
    other_base = tiny_model_factory("llama", hidden_size=48)
    cases = {
        "another base": (make_adapter(other_base, tmp_path / "other", rank=4), "is the adapter for another model"),
        "missing": (tmp_path / "missing", "is not a folder"),
        "unknown target": (make_adapter(base, tmp_path / "head", rank=4, targets=["lm_head"]),
                           "is not a LoRA pair of a decoder layer"),
        "rank": (adapters["r64"], "has rank 64.*the limit is 32"),
    }
    empty = tmp_path / "empty"
    empty.mkdir()
    cases["no config"] = (empty, "has no adapter_config.json")
    dora = make_adapter(base, tmp_path / "dora", rank=4)
    _edit_config(dora, use_dora=True)
    cases["dora"] = (dora, "DoRA")
    broken = make_adapter(base, tmp_path / "broken", rank=4)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    cases["broken"] = (broken, "is not a readable safetensors file")
    for what, (folder, message) in cases.items():
        with pytest.raises(ModelError, match=message) as caught:
            engine_for(base, {"x": folder}, max_lora_rank=32)
        assert "\n" not in str(caught.value), what


def test_lora_settings_are_checked():
    with pytest.raises(PagecliError, match="given twice"):
        EngineConfig(loras=(("a", "/x"), ("a", "/y")))
    with pytest.raises(PagecliError, match="max_loras must be at least 1"):
        EngineConfig(max_loras=0)
    with pytest.raises(PagecliError, match="lora_scale must be between"):
        SamplingParams(lora="a", lora_scale=-1)


def test_an_adapter_of_a_mixture_of_experts_mlp_is_refused_in_one_sentence(tiny_model_factory, tmp_path):
    from pagecli.errors import ModelError

    base = tiny_model_factory("qwen3_moe")
    adapter = make_adapter(base, tmp_path / "experts", rank=4, seed=1)  # attention and MLP: PEFT wraps the experts
    with pytest.raises(ModelError, match="LoRA adapter 'a'"):
        engine_for(base, {"a": adapter})
