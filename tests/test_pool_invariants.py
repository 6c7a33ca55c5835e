"""The pool check that runs after every engine test (conftest.py) finds engines and bites on leaks."""

from __future__ import annotations

import pytest
from pool_checks import check_engine_pool

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.engine.hashing import block_hash
from pagecli.models.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def make_engine(folder, **config) -> Engine:
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "block_size": 4, "num_blocks": 32,
                "disk_cache": False, **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))


def test_every_engine_a_test_builds_is_recorded_for_the_check(tiny_llama, engines_checked_after_test):
    first = make_engine(tiny_llama)
    second = make_engine(tiny_llama, block_size=8)
    assert engines_checked_after_test.engines == [first, second]


def test_an_engine_that_finished_its_requests_passes(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.generate(["The quick brown fox jumps over the lazy dog.", "Hello world!"], GREEDY)
    check_engine_pool(engine)


def test_a_block_leaked_by_an_idle_engine_fails_the_check(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.generate(["Hello world!"], GREEDY)
    leaked = engine.pool.allocate()  # taken and never given back
    with pytest.raises(AssertionError, match="ref_count 1 but 0 sequence"):
        check_engine_pool(engine)
    engine.pool.release(leaked)  # so this test's own teardown check passes
    check_engine_pool(engine)


def test_a_running_sequence_with_one_reference_too_many_fails_the_check(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request("The quick brown fox jumps over the lazy dog.", GREEDY)
    engine.step()
    seq = engine.scheduler.running[0]
    block = engine.pool.blocks[seq.block_table[0]]
    engine.pool.touch(block)
    with pytest.raises(AssertionError, match="ref_count 2 but 1 sequence"):
        check_engine_pool(engine)
    engine.pool.release(block)
    list(engine.stream())


def test_a_cached_block_holding_other_tokens_than_it_was_hashed_for_fails_the_check(
        tiny_llama, engines_checked_after_test):
    hash_inputs = engines_checked_after_test.hash_inputs
    engine = make_engine(tiny_llama)
    engine.generate(["The quick brown fox jumps over the lazy dog."], GREEDY)
    check_engine_pool(engine, hash_inputs)
    block_id = next(iter(engine.pool.hash_to_block.values()))
    block = engine.pool.blocks[block_id]
    right_tokens = block.token_ids
    block.token_ids = tuple(reversed(right_tokens))
    with pytest.raises(AssertionError, match="other tokens than the ones its hash was computed from"):
        check_engine_pool(engine, hash_inputs)
    block.token_ids = right_tokens


def test_a_sequence_whose_hashes_are_not_its_token_chain_fails_the_check(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request("The quick brown fox jumps over the lazy dog.", GREEDY)
    engine.step()
    seq = engine.scheduler.running[0]
    assert seq.block_hashes, "the prompt fills at least one block"
    right = seq.block_hashes[0]
    seq.block_hashes[0] = block_hash(engine.kv.root_hash, [0, 0, 0, 0])
    with pytest.raises(AssertionError, match="not the chain of its tokens"):
        check_engine_pool(engine)
    seq.block_hashes[0] = right
    list(engine.stream())


def test_request_state_left_behind_by_an_idle_engine_fails_the_check(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.generate(["Hello world!"], GREEDY)
    engine._requests["ghost"] = object()
    with pytest.raises(AssertionError, match="request state"):
        check_engine_pool(engine)
    del engine._requests["ghost"]


def test_a_leaking_test_fails_at_teardown(pytester, tiny_llama):
    """End to end: a test that leaks a block is reported as an error by the fixture, not as a pass."""
    from pathlib import Path

    tests_dir = Path(__file__).parent
    for name in ("conftest.py", "pool_checks.py", "tiny_models.py", "user_files.py"):
        pytester.makepyfile(**{name.removesuffix(".py"): (tests_dir / name).read_text()})
    pytester.makepyfile(test_leak=f"""
        from pathlib import Path

        from pagecli.config import EngineConfig
        from pagecli.engine import Engine
        from pagecli.models.loader import load_model

        def test_leaks_one_block():
            config = EngineConfig(dtype="float32", device="cpu", attention="torch", num_blocks=8, disk_cache=False)
            loaded = load_model(Path({str(tiny_llama)!r}), "float32", "cpu", max_positions=64)
            engine = Engine(config=config, loaded=loaded)
            engine.pool.allocate()
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)  # the test body passed; its teardown check did not
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaks_one_block*", "*ref_count 1 but 0 sequence*"])
