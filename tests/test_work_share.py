"""How the CPU kernels share a parallel region's work (pagecli/native/work_share.h): each unit is
computed once, and a thread that starts late (held off its core by another process) finds its
units taken by the threads that were on time, instead of keeping them waiting."""

from __future__ import annotations

import pytest

from native_levels import ops, skip_without_native, threads  # noqa: F401 - ops: the fixture, once per compiled level

skip_without_native()


@pytest.mark.parametrize(("units", "count"), [(1, 2), (7, 2), (64, 2), (100, 3)])
def test_every_unit_is_taken_exactly_once(ops, units, count):
    with threads(count):
        takers = ops.shared_work_takers(units, -1, 0)
    assert len(takers) == units
    assert all(0 <= t < count for t in takers), takers  # -1: never taken, -2: taken twice


@pytest.mark.parametrize("late", [0, 1])
def test_a_late_thread_finds_its_share_taken_by_the_thread_on_time(ops, late):
    with threads(2):
        takers = ops.shared_work_takers(64, late, 300)
    # Shares are units 0-31 and 32-63; the late owner sleeps 300 ms before it looks for work, long
    # after the other thread has been through its own 32 units and every unit of the late share.
    assert takers == [1 - late] * 64


@pytest.mark.parametrize(("units", "count"), [(1, 2), (5, 2), (64, 2), (7, 3), (2, 3)])
def test_a_team_hands_out_every_unit_of_each_region_once(ops, units, count):
    # run_team: one parallel region in which the members run several parallel_shared calls in step
    # (DecodeStep's layer loop); fewer units than members leave some only taking over.
    with threads(count):
        takers = ops.team_work_takers(units, 4, -1)
    assert len(takers) == 4 * units
    assert all(0 <= t < count for t in takers), takers


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_team_member_raises_its_error_without_leaving_the_others_waiting(ops, failing):
    with threads(2):
        with pytest.raises(RuntimeError, match=f"team member {failing} failed"):
            ops.team_work_takers(16, 3, failing)
        assert len(ops.team_work_takers(16, 2, -1)) == 32  # the thread pool is fine afterwards
