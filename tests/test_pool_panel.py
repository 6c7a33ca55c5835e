"""The block-pool panel shows exactly the engine's stats snapshot: states, memory, tokens that fit, the turn."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from rich.console import Console

from pagecli.chat.conversation import Conversation
from pagecli.chat.prompt import PromptBuilder
from pagecli.chat.turn import TurnStats, TurnTracker, run_turn
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.ui.chat_screen import stats_table
from pagecli.ui.pool_panel import STATE_STYLES, format_bytes, group_states, pool_panel


def render(renderable, width: int = 120) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_engine(folder) -> Engine:
    return Engine(str(folder), EngineConfig(device="cpu", dtype="float32", attention="torch", num_blocks=48,
                                            threads=1))


def figure(text: str, pattern: str) -> tuple[str, ...]:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in {text!r}"
    return match.groups()


def map_line(text: str) -> str:
    return text.splitlines()[1].strip("│ ")


def test_panel_figures_equal_the_engine_snapshot_mid_turn(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = PromptBuilder(engine).build(Conversation(system="sys").messages("Tell me about paged attention."))
    tracker = TurnTracker(engine, len(prompt.token_ids))
    snapshots = []
    run_turn(engine, prompt.token_ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), tracker,
             on_step=lambda: snapshots.append(tracker.live_status()))
    stats, turn = snapshots[2]  # in the middle of decoding: the sequence holds active blocks
    assert stats.blocks_active > 0

    text = render(pool_panel(stats, turn))
    active, active_pct, shared, cached, free = figure(
        text, r"active (\d+) \(([\d.]+)%\), shared (\d+) \([\d.]+%\) · cached (\d+) \([\d.]+%\) · free (\d+)")
    assert (int(active), int(shared), int(cached), int(free)) == (
        stats.blocks_active, stats.blocks_shared, stats.blocks_cached, stats.blocks_free)
    assert int(active) + int(cached) + int(free) == stats.num_blocks == 48
    assert float(active_pct) == round(100 * stats.blocks_active / 48, 1)
    assert f"{stats.num_blocks} blocks × {stats.block_size} tokens" in text
    assert f"KV {format_bytes(stats.kv_bytes_used)} used of {format_bytes(stats.kv_bytes_total)}" in text
    assert f"{stats.tokens_that_fit:,} tokens still fit" in text
    assert (f"turn: prompt {turn.prompt_tokens} · cached {turn.cached_tokens} memory + "
            f"{turn.cached_disk_tokens} disk · prefilled {turn.prefilled_tokens}") in text
    cells = map_line(text)
    assert len(cells) == 48  # one cell per block
    for state, (glyph, _) in STATE_STYLES.items():
        assert cells.count(glyph) == stats.block_states.count(state)
    assert "1 cell = 1 block" in text


def test_shared_prefix_blocks_are_drawn_and_counted_as_shared(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = list(range(3, 3 + 40))  # two full blocks and a tail
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.generate([prompt], greedy)  # leaves the two full blocks cached
    engine.add_request(prompt, greedy)
    engine.add_request(prompt, greedy)
    engine.step()  # both requests take references to the cached blocks
    stats = engine.stats(include_block_states=True)
    assert stats.blocks_shared == 2
    text = render(pool_panel(stats))
    assert "shared 2 (4.2%)" in text
    assert map_line(text).count(STATE_STYLES["shared"][0]) == 2


def test_a_big_pool_is_drawn_in_groups_with_a_legend(tiny_llama):
    snapshot = make_engine(tiny_llama).stats()
    states = ("active",) * 900 + ("cached",) * 3100 + ("free",) * 6000
    stats = replace(snapshot, num_blocks=10_000, blocks_active=900, blocks_cached=3100, blocks_free=6000,
                    blocks_shared=0, block_states=states)
    cells, group = group_states(states, 256)
    assert group == 40 and len(cells) == 250
    text = render(pool_panel(stats))
    assert "1 cell = 40 blocks" in text
    assert "active 900 (9.0%)" in text and "cached 3100 (31.0%)" in text and "free 6000 (60.0%)" in text


def test_turn_figures_and_stats_table_read_the_same_snapshot(tiny_llama):
    stats = make_engine(tiny_llama).stats()
    turn = TurnStats(prompt_tokens=52, cached_tokens=32, cached_disk_tokens=16, prefilled_tokens=4,
                     completion_tokens=9, ttft_s=0.0214, decode_tokens_per_s=45.06)
    text = render(pool_panel(stats, turn))
    assert "turn: prompt 52 · cached 32 memory + 16 disk · prefilled 4 · TTFT 21 ms · decode 45.1 tok/s" in text
    table = render(stats_table(stats))
    for key in stats.to_dict():
        assert key in table


def test_a_grouped_cell_shows_the_most_significant_state_it_holds():
    # 9 blocks a cell: a short chat's 3 cached blocks share one cell with 6 free ones, and must show.
    states = ("cached",) * 3 + ("free",) * 2301
    cells, group = group_states(states, 256)
    assert group == 9
    assert cells[0] == "cached" and set(cells[1:]) == {"free"}
    mixed = ("free",) * 5 + ("active",) + ("cached",) * 2 + ("shared",)
    assert group_states(mixed * 300, 256)[0][0] == "shared"
    assert group_states((("free",) * 7 + ("active",) + ("cached",)) * 300, 256)[0][0] == "active"


def test_speculation_shows_once_drafts_were_checked(tiny_llama):
    snapshot = make_engine(tiny_llama).stats()
    assert "speculation" not in render(pool_panel(snapshot))  # off, or nothing checked yet
    stats = replace(snapshot, spec_method="draft", spec_drafts=200, spec_accepted=130, spec_passes=60, spec_tokens=190)
    assert "speculation (draft): 65% of 200 drafts accepted · 3.17 tokens a checking pass" in render(pool_panel(stats))
