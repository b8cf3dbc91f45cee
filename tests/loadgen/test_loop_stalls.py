"""The load runner's event-loop stall probe: a client that was itself late says so."""

from __future__ import annotations

import asyncio
import time

from tokentrace.loadgen.runner import _LoopStalls

BLOCK_S = 0.2


def test_a_blocked_loop_is_a_stall_counted_even_before_the_probe_wakes() -> None:
    async def scenario() -> tuple[int, int, int, int, dict[str, int]]:
        stalls = _LoopStalls(time.monotonic_ns)
        probe = asyncio.create_task(stalls.run())
        await asyncio.sleep(0.03)
        start = time.monotonic_ns()
        time.sleep(BLOCK_S)  # the loop cannot run: a reader woken now would be late
        end = time.monotonic_ns()
        in_progress = stalls.within(start, end)  # the probe has not woken to record it yet
        await asyncio.sleep(0.03)
        recorded = stalls.within(start, end)
        before = stalls.within(start - 10 * BLOCK_S * 10**9, start - 5 * BLOCK_S * 10**9)
        probe.cancel()
        return end - start, in_progress, recorded, before, stalls.stats()

    blocked, in_progress, recorded, before, stats = asyncio.run(scenario())
    # Bounded below by the block (a loaded CI machine may stall the loop more, never less) and
    # above by the window asked about: stalls are disjoint intervals, clipped to it.
    assert 0.7 * BLOCK_S * 1e9 <= in_progress <= blocked
    assert 0.7 * BLOCK_S * 1e9 <= recorded <= blocked
    assert before == 0  # nothing outside the window
    assert stats["client_stalls"] >= 1
    assert stats["client_longest_stall_ns"] >= 0.7 * BLOCK_S * 1e9
    assert stats["client_stall_ns"] >= stats["client_longest_stall_ns"]


def test_an_idle_loop_has_no_stalls_in_a_window() -> None:
    async def scenario() -> int:
        stalls = _LoopStalls(time.monotonic_ns)
        probe = asyncio.create_task(stalls.run())
        start = time.monotonic_ns()
        await asyncio.sleep(0.05)
        stalled = stalls.within(start, time.monotonic_ns())
        probe.cancel()
        return stalled

    # An idle loop wakes on time, give or take CI noise: it must never look like the blocked
    # loop above (the least that test counts as a stall).
    assert asyncio.run(scenario()) < 0.7 * BLOCK_S * 1e9
