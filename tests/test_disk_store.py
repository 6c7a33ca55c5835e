"""The disk prefix store: prefixes survive the process, never cross models, survive damage, stay under the cap."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.engine.hashing import chain_hashes, root_hash
from engine_probes import recorded_logits
from pagecli.models.loader import load_model
from pagecli.store import maintenance
from pagecli.store.files import INDEX_NAME
from pagecli.store.blobs import BlockGeometry
from pagecli.store.index import StoreIndex, StoreLocked
from pagecli.store.prefix_store import BlockRecord, PrefixStore
from pagecli.store.pruning import plan_prune

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SYSTEM = "Paged attention keeps the KV cache in fixed-size blocks. " * 4
PROMPT = SYSTEM + "The quick brown fox jumps over the lazy dog."


def make_engine(folder: Path, store: Path, dtype: str = "float32", **config) -> Engine:
    settings = {"dtype": dtype, "device": "cpu", "attention": "torch", "block_size": BLOCK_SIZE, "num_blocks": 256,
                "disk_cache_dir": str(store), **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, dtype, "cpu", max_positions=512))


def full_blocks_served(num_tokens: int) -> int:
    """Tokens a prefix hit can serve: every full block but one holding the last token."""
    return (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture()
def store(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture(scope="module")
def baseline(tiny_llama, tmp_path_factory):
    """PROMPT from scratch without any store: tokens and first-step logits."""
    engine = make_engine(tiny_llama, tmp_path_factory.mktemp("unused"), disk_cache=False)
    logits = recorded_logits(engine)
    out = engine.generate([PROMPT], GREEDY)[0]
    return out.token_ids, logits[0]


def persisted_engine(folder: Path, store: Path, prompt: str = PROMPT) -> Engine:
    """An engine that has run prompt and written its full blocks to the store (and closed it)."""
    engine = make_engine(folder, store)
    engine.generate([prompt], GREEDY)
    assert engine.persist_prefix(engine.encode(prompt)) == len(engine.encode(prompt)) // BLOCK_SIZE
    engine.close()
    return engine


# --- round trip -----------------------------------------------------------------------------------
def test_blocks_restored_from_disk_give_the_same_kv_tokens_and_logits(tiny_llama, store, baseline):
    first = persisted_engine(tiny_llama, store)
    ids = first.encode(PROMPT)
    num_restored = full_blocks_served(len(ids)) // BLOCK_SIZE
    computed_kv = first.runner.copy_blocks_out([b.block_id for b in first.kv.cached_prefix(ids)[:num_restored]])

    second = make_engine(tiny_llama, store)
    logits = recorded_logits(second)
    out = second.generate([PROMPT], GREEDY)[0]
    assert second.stats().prefix_disk_hit_tokens == num_restored * BLOCK_SIZE
    restored_kv = second.runner.copy_blocks_out([b.block_id for b in second.kv.cached_prefix(ids)[:num_restored]])

    assert torch.equal(restored_kv, computed_kv), "restored KV differs bit for bit"
    assert out.token_ids == baseline[0]
    torch.testing.assert_close(logits[0], baseline[1], atol=1e-4, rtol=0)
    memory_hit = make_engine(tiny_llama, store, disk_cache=False)
    memory_hit.generate([PROMPT], GREEDY)
    memory_logits = recorded_logits(memory_hit)
    memory_hit.generate([PROMPT], GREEDY)  # served from the pool: the same cached prefix, the same tail
    assert torch.equal(logits[0], memory_logits[0]), "a disk hit must compute exactly what a memory hit does"
    second.pool.check_invariants()


def test_new_engine_on_the_same_store_prefills_only_after_the_cached_blocks(tiny_llama, store):
    persisted_engine(tiny_llama, store)
    engine = make_engine(tiny_llama, store)
    out = engine.generate([PROMPT], GREEDY)[0]
    stats = engine.stats()
    served = full_blocks_served(out.prompt_tokens)
    assert stats.prefix_disk_hit_tokens == served
    assert stats.prefix_hit_tokens == 0
    assert stats.prompt_tokens_computed == out.prompt_tokens - served
    assert out.cached_tokens == served
    again = engine.generate([PROMPT], GREEDY)[0]  # now the blocks are in the pool: memory hits
    assert engine.stats().prefix_hit_tokens == served and again.token_ids == out.token_ids


def test_chat_history_written_after_a_turn_is_served_from_disk_in_a_new_engine(tiny_llama, store):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello world!"}]
    first = make_engine(tiny_llama, store)
    prompt_ids = first.encode(messages)
    reply = first.generate([prompt_ids], GREEDY)[0]
    conversation_ids = prompt_ids + list(reply.token_ids)
    written = first.persist_prefix(conversation_ids)  # what chat does at the end of a turn
    first.close()
    # Every full block whose KV was computed: the reply's last token never went through the model.
    assert written == (len(conversation_ids) - 1) // BLOCK_SIZE

    second = make_engine(tiny_llama, store)
    next_turn = conversation_ids + second.encode("<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n")
    out = second.generate([next_turn], GREEDY)[0]
    assert second.stats().prefix_disk_hit_tokens == written * BLOCK_SIZE
    assert second.stats().prompt_tokens_computed == out.prompt_tokens - written * BLOCK_SIZE


# --- never a foreign hit ----------------------------------------------------------------------------
@pytest.mark.parametrize("change", ["other weights", "bfloat16", "block size 8"])
def test_another_model_dtype_or_block_size_never_hits(change, tiny_llama, tiny_model_factory, store):
    persisted_engine(tiny_llama, store)
    if change == "other weights":
        engine = make_engine(tiny_model_factory("llama", seed=1), store)
    elif change == "bfloat16":
        engine = make_engine(tiny_llama, store, dtype="bfloat16")
    else:
        engine = make_engine(tiny_llama, store, block_size=8)
    engine.generate([PROMPT], GREEDY)
    assert engine.stats().prefix_disk_hit_tokens == 0
    assert engine.take_warnings() == []


def test_the_same_weights_in_another_folder_do_hit(tiny_llama, store, tmp_path):
    persisted_engine(tiny_llama, store)
    copy = shutil.copytree(tiny_llama, tmp_path / "copy-of-the-model")
    engine = make_engine(copy, store)
    engine.generate([PROMPT], GREEDY)
    assert engine.stats().prefix_disk_hit_tokens > 0


# --- damage ------------------------------------------------------------------------------------------
def _blob_at_depth(store: Path, depth: int) -> Path:
    index = StoreIndex.open(store)
    try:
        [row] = [b for b in index.all_blocks() if b.depth == depth]
    finally:
        index.close()
    return store / row.blob_path


def _flip_bytes(store: Path) -> None:
    path = _blob_at_depth(store, 3)
    data = bytearray(path.read_bytes())
    data[-100:-90] = bytes(b ^ 0xFF for b in data[-100:-90])
    path.write_bytes(bytes(data))


def _truncate(store: Path) -> None:
    path = _blob_at_depth(store, 3)
    path.write_bytes(path.read_bytes()[:1000])


def _delete(store: Path) -> None:
    _blob_at_depth(store, 3).unlink()


def _garbage_index(store: Path) -> None:
    (store / INDEX_NAME).write_bytes(os.urandom(4096))


@pytest.mark.parametrize("damage", [_flip_bytes, _truncate, _delete, _garbage_index],
                         ids=["flipped bytes", "truncated blob", "deleted blob", "garbage index"])
def test_damage_is_reported_once_and_the_output_stays_right(damage, tiny_llama, store, baseline):
    persisted_engine(tiny_llama, store)
    damage(store)
    engine = make_engine(tiny_llama, store)
    out = engine.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == baseline[0]
    warnings = engine.take_warnings()
    assert len(warnings) == 1, warnings
    served_from_disk = 0 if damage is _garbage_index else 3 * BLOCK_SIZE  # the blocks before the bad one
    assert engine.stats().prefix_disk_hit_tokens == served_from_disk
    engine.persist_prefix(engine.encode(PROMPT))  # the store keeps working: the chain is whole again
    engine.close()
    assert maintenance.check(store) == []
    assert maintenance.list_models(store, [])[0].entries == out.prompt_tokens // BLOCK_SIZE


# --- concurrency -------------------------------------------------------------------------------------
READER = """
import json, sys, time
from pathlib import Path
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.loader import load_model
folder, store, prompt, other = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
config = EngineConfig(dtype="float32", device="cpu", attention="torch", block_size=4, num_blocks=256,
                      disk_cache_dir=store)
engine = Engine(config=config, loaded=load_model(folder, "float32", "cpu", max_positions=512))
out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
stats = engine.stats()
print(json.dumps({"tokens": list(out.token_ids), "disk_hit_tokens": stats.prefix_disk_hit_tokens,
                  "prompt_tokens_computed": stats.prompt_tokens_computed, "warnings": engine.take_warnings()}))
engine.generate([other], SamplingParams(temperature=0, max_tokens=1))
write_run = engine.disk.store.write_run
engine.disk.store.write_run = lambda *args: (time.sleep(1.0), write_run(*args))  # a slow disk
engine.persist_prefix(engine.encode(other))  # queued for the writer thread; the process exits without close()
"""


def test_a_new_process_prefills_only_after_the_stored_blocks_and_its_queued_writes_land_at_exit(
        tiny_llama, store, baseline):
    persisted_engine(tiny_llama, store)
    other = "Hello world! How are you today? " * 2
    child = subprocess.run([sys.executable, "-c", READER, str(tiny_llama), str(store), PROMPT, other],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.strip().splitlines()[-1])
    engine = make_engine(tiny_llama, store, disk_cache=False)
    n = len(engine.encode(PROMPT))
    assert report["disk_hit_tokens"] == full_blocks_served(n)
    assert report["prompt_tokens_computed"] == n - full_blocks_served(n)
    assert tuple(report["tokens"]) == baseline[0] and report["warnings"] == []
    assert _stored_depths(store, engine, other) == list(range(len(engine.encode(other)) // BLOCK_SIZE))


WRITER = """
import json, sys
from pathlib import Path
import torch
from pagecli.engine.hashing import chain_hashes, root_hash
from pagecli.store.blobs import BlockGeometry
from pagecli.store.prefix_store import BlockRecord, PrefixStore
store_dir, max_bytes = Path(sys.argv[1]), int(sys.argv[2])
geometry = BlockGeometry(num_layers=2, block_size=4, kv_heads=2, head_dim=16, dtype=torch.float32)
warnings = []
store = PrefixStore(store_dir, "layout=1|test", "writer", geometry, max_bytes, warnings.append)
root = root_hash("layout=1|test")
print("ready", flush=True)
sys.stdin.readline()
wrong = 0
for round in range(3):
    for prompt in range(8):
        tokens = [1, 2, 3, 4, 5, 6, 7, 8] + [prompt] * 4 + list(range(32))  # a shared head, then its own blocks
        blocks = [tokens[i : i + 4] for i in range(0, len(tokens), 4)]
        hashes = chain_hashes(root, tokens, 4, len(blocks))
        records = [BlockRecord(h, hashes[i - 1] if i else root, i, tuple(b))
                   for i, (h, b) in enumerate(zip(hashes, blocks))]
        kv = torch.stack([torch.full(geometry.block_shape, float(h[0])) for h in hashes], dim=2)
        store.write_run(records, kv)
        run = store.find_run(hashes, blocks)
        loaded = store.read_run(run)
        if loaded is not None:
            wrong += int(not torch.equal(loaded, kv[:, :, : loaded.shape[2]]))
store.close()
print(json.dumps({"warnings": warnings, "wrong_reads": wrong}))
"""


def test_two_processes_writing_the_same_prompts_at_once_leave_a_consistent_index(store):
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # tensor bytes of one block of WRITER's geometry
    cap_bytes = 60 * (block_bytes + 256)  # under the 8 prompts' 80 distinct blocks: both processes also prune
    children = [subprocess.Popen([sys.executable, "-c", WRITER, str(store), str(cap_bytes)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for child in children:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
    for child in children:  # released together, once both have started
        child.stdin.write("go\n")
        child.stdin.flush()
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"warnings": [], "wrong_reads": 0}
    assert maintenance.check(store) == []
    assert 0 < maintenance.store_stats(store, []).num_bytes <= cap_bytes
    _assert_chains_start_at_their_heads(store)


def test_a_parent_pruned_between_the_presence_check_and_the_insert_keeps_its_children_out(store, monkeypatch):
    """Another process prunes the stored tail of a chain while this one writes its continuation:
    the continuation is not indexed (it would start a chain mid-prompt) and its blobs go."""
    geometry = BlockGeometry(num_layers=2, block_size=4, kv_heads=2, head_dim=16, dtype=torch.float32)
    prefix_store = PrefixStore(store, "layout=1|test", "writer", geometry, None, pytest.fail)
    root = root_hash("layout=1|test")
    tokens = list(range(16))
    hashes = chain_hashes(root, tokens, 4, 4)
    records = [BlockRecord(h, hashes[i - 1] if i else root, i, tuple(tokens[4 * i: 4 * i + 4]))
               for i, h in enumerate(hashes)]
    kv = torch.stack([torch.full(geometry.block_shape, float(i)) for i in range(4)], dim=2)
    assert prefix_store.write_run(records[:2], kv[:, :, :2]) == 2
    insert = StoreIndex.insert

    def pruned_first(index, blocks):
        with sqlite3.connect(store / INDEX_NAME) as other:  # the other process: drops the tail, block 1
            path = other.execute("SELECT blob_path FROM blocks WHERE depth = 1").fetchone()[0]
            other.execute("DELETE FROM blocks WHERE depth = 1")
        (store / path).unlink()
        return insert(index, blocks)

    monkeypatch.setattr(StoreIndex, "insert", pruned_first)
    assert prefix_store.write_run(records, kv) == 0
    prefix_store.close()
    assert _stored_depths_of(store, hashes) == [0]
    assert maintenance.check(store) == []


# --- write policy and settings ------------------------------------------------------------------------
def test_generate_stores_prompt_blocks_shared_by_two_requests_and_nothing_unshared(tiny_llama, store):
    engine = make_engine(tiny_llama, store)
    engine.generate(["The quick brown fox jumps over the lazy dog."], GREEDY)
    engine.flush_disk_writes()
    assert maintenance.list_models(store, [])[0].entries == 0
    engine.generate([PROMPT], GREEDY)
    second = SYSTEM + "Hello world! How are you today?"
    reused = engine.generate([second], GREEDY)[0].cached_tokens  # SYSTEM's blocks, found in the pool
    engine.close()
    assert reused > 0
    assert maintenance.list_models(store, [])[0].entries == reused // BLOCK_SIZE


def test_cache_all_prompts_stores_every_full_prompt_block(tiny_llama, store):
    engine = make_engine(tiny_llama, store, disk_cache_all_prompts=True)
    engine.generate([PROMPT], GREEDY)
    engine.close()  # closing waits for the background writes
    assert maintenance.list_models(store, [])[0].entries == len(engine.encode(PROMPT)) // BLOCK_SIZE


def test_disk_cache_off_writes_and_reads_nothing(tiny_llama, store):
    engine = make_engine(tiny_llama, store, disk_cache=False)
    engine.generate([PROMPT], GREEDY)
    assert engine.persist_prefix(engine.encode(PROMPT)) == 0
    assert not store.exists()


def test_pagecli_cache_dir_moves_the_store(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGECLI_CACHE_DIR", str(tmp_path / "elsewhere"))
    engine = make_engine(tiny_llama, tmp_path / "unused", disk_cache_dir=None, disk_cache_all_prompts=True)
    engine.generate([PROMPT], GREEDY)
    engine.close()
    assert maintenance.list_models(tmp_path / "elsewhere", [])[0].entries > 0


def test_the_store_directory_is_private(tiny_llama, store):
    persisted_engine(tiny_llama, store)
    assert store.stat().st_mode & 0o777 == 0o700


# --- size cap and pruning -------------------------------------------------------------------------------
def test_pruning_removes_the_least_recently_used_tails_first():
    def row(name, parent, last_used, depth):
        return (name.encode(), parent.encode(), last_used, depth, 100)

    # Chain a1-a2-a3 used long ago, chain b1-b2 recently; a1 also continues into c2 (used in between).
    rows = [row("a1", "root", 1, 0), row("a2", "a1", 1, 1), row("a3", "a2", 1, 2),
            row("c2", "a1", 5, 1), row("b1", "root", 9, 0), row("b2", "b1", 9, 1)]
    assert plan_prune(rows, 600) == []
    assert plan_prune(rows, 300) == [b"a3", b"a2", b"c2"]  # a1 is still a head of nothing left: next in line
    assert plan_prune(rows, 100) == [b"a3", b"a2", b"c2", b"a1", b"b2"]


def test_the_size_cap_keeps_the_store_small_and_keeps_chains_whole(tiny_llama, store):
    engine = make_engine(tiny_llama, store, disk_cache_all_prompts=True)
    engine.generate([PROMPT], GREEDY)
    engine.close()
    before = maintenance.store_stats(store, [])
    blob_bytes = before.num_bytes // before.entries
    cap_bytes = 10 * blob_bytes + blob_bytes // 2
    capped = make_engine(tiny_llama, store, disk_cache_all_prompts=True, disk_cache_max_gib=cap_bytes / (1 << 30))
    newer = "Hello world! How are you today? " * 2
    capped.generate([newer], GREEDY)  # a newer chain pushes the old one out, tail first
    capped.close()
    assert maintenance.store_stats(store, []).num_bytes <= cap_bytes
    depths = _stored_depths(store, capped, PROMPT)
    assert depths == list(range(len(depths))) and len(depths) < before.entries, "the old chain lost its tail"
    newer_blocks = len(capped.encode(newer)) // BLOCK_SIZE
    assert _stored_depths(store, capped, newer) == list(range(newer_blocks)), "the newer chain stays whole"
    _assert_chains_start_at_their_heads(store)


def test_cache_prune_command_shrinks_to_the_size_given(tiny_llama, store, capsys):
    import pagecli.cli.cache_cmd  # noqa: F401 - registers `pagecli cache`
    from pagecli.cli import main

    engine = make_engine(tiny_llama, store, disk_cache_all_prompts=True)
    engine.generate([PROMPT, "Hello world! How are you today? " * 3], GREEDY)
    engine.close()
    total = maintenance.store_stats(store, []).num_bytes
    assert main(["cache", "prune", "--max-size", f"{total // 2}B", "--json", "--cache-dir", str(store)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_left"] <= total // 2
    assert report["num_bytes"] == total - report["bytes_left"] > 0
    _assert_chains_start_at_their_heads(store)
    assert main(["cache", "ls", "--json", "--cache-dir", str(store)]) == 0
    [model] = json.loads(capsys.readouterr().out)["models"]
    assert model["kv_dtype"] == "float32" and model["block_size"] == BLOCK_SIZE and model["entries"] > 0
    assert main(["cache", "clear", "--model", model["name"], "--cache-dir", str(store)]) == 0
    assert main(["cache", "stats", "--json", "--cache-dir", str(store)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["entries"] == 0
    assert main(["cache", "clear", "--model", "no-such-model", "--cache-dir", str(store)]) == 2


def _stored_depths(store: Path, engine: Engine, prompt: str) -> list[int]:
    """Positions of the prompt's blocks that the store holds."""
    ids = engine.encode(prompt)
    return _stored_depths_of(store, chain_hashes(engine.kv.root_hash, ids, BLOCK_SIZE, len(ids) // BLOCK_SIZE))


def _stored_depths_of(store: Path, chain: list[bytes]) -> list[int]:
    with sqlite3.connect(store / INDEX_NAME) as conn:
        stored = {r[0] for r in conn.execute("SELECT block_hash FROM blocks")}
    return [depth for depth, h in enumerate(chain) if h in stored]


def _assert_chains_start_at_their_heads(store: Path) -> None:
    """Every stored block's parent is stored too, unless it is the first block of a prompt."""
    with sqlite3.connect(store / INDEX_NAME) as conn:
        rows = conn.execute("SELECT block_hash, parent_hash, depth FROM blocks").fetchall()
    stored = {r[0] for r in rows}
    assert rows
    assert all(depth == 0 or parent in stored for _, parent, depth in rows)


class _LockedOnce(sqlite3.Connection):
    """A connection that answers "database is locked" to the first WAL switch, as SQLite does at once
    (without waiting its busy timeout) when two processes set up a new index together."""
    refusals = 0

    def execute(self, sql, *args):
        if sql.startswith("PRAGMA journal_mode") and _LockedOnce.refusals == 0:
            _LockedOnce.refusals += 1
            raise sqlite3.OperationalError("database is locked")
        return super().execute(sql, *args)


def test_opening_an_index_another_process_is_setting_up_waits_instead_of_failing(store, monkeypatch):
    connect = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda *args, **kwargs: connect(*args, factory=_LockedOnce, **kwargs))
    index = StoreIndex.open(store, busy_timeout_s=5.0)
    try:
        assert _LockedOnce.refusals == 1
        assert index.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert index.model_id("fp", "model") > 0
    finally:
        index.close()


def test_an_index_locked_past_the_timeout_still_fails_as_locked(store, monkeypatch):
    class AlwaysLocked(sqlite3.Connection):
        def execute(self, sql, *args):
            if sql.startswith("PRAGMA journal_mode"):
                raise sqlite3.OperationalError("database is locked")
            return super().execute(sql, *args)

    connect = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda *args, **kwargs: connect(*args, factory=AlwaysLocked, **kwargs))
    with pytest.raises(StoreLocked):
        StoreIndex.open(store, busy_timeout_s=0.1)
