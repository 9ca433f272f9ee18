"""The router's queue: priority by class, promotion at 70% of the TTFT budget, bounded slots."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.router.admission import PROMOTED, EngineSlots, Waiter, WaitQueue


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_higher_class_first_then_arrival_order() -> None:
    q = WaitQueue(0.7)
    batch = q.push(Waiter(priority=2, enqueued_s=0.0, ttft_budget_s=100.0))
    std1 = q.push(Waiter(priority=1, enqueued_s=0.1, ttft_budget_s=10.0))
    std2 = q.push(Waiter(priority=1, enqueued_s=0.2, ttft_budget_s=10.0))
    crit = q.push(Waiter(priority=0, enqueued_s=0.3, ttft_budget_s=0.3 * 1000))
    assert [q.pop(0.5) for _ in range(4)] == [crit, std1, std2, batch]
    assert q.pop(0.5) is None


@pytest.mark.parametrize(("waited", "promoted"), [(6.9, False), (7.0, True)])
def test_a_waiter_past_70_percent_of_its_budget_is_promoted(waited: float, promoted: bool) -> None:
    q = WaitQueue(0.7)
    old_batch = q.push(Waiter(priority=2, enqueued_s=0.0, ttft_budget_s=10.0))
    crit = q.push(Waiter(priority=0, enqueued_s=waited - 0.01, ttft_budget_s=100.0))
    assert (q.effective_priority(old_batch, waited) == PROMOTED) is promoted
    assert q.pop(waited) is (old_batch if promoted else crit)
    assert q.num_promoted == int(promoted)


def test_predicted_wait_counts_only_waiters_served_before() -> None:
    q = WaitQueue(0.7)
    for priority in (0, 1, 1, 2):
        q.push(Waiter(priority, 0.0, 10.0))
    assert q.predicted_wait_s(1, 2.0) == 6.0
    assert q.predicted_wait_s(0, 2.0) == 2.0


def test_slots_bound_concurrency_and_grant_by_priority() -> None:
    async def run() -> list[str]:
        clock = FakeClock()
        slots = EngineSlots(1, 0.7, clock)
        order: list[str] = []
        await slots.acquire(1, 10.0)  # the one slot

        async def wait(name: str, priority: int) -> None:
            await slots.acquire(priority, 10.0)
            order.append(name)
            slots.release()

        tasks = [asyncio.create_task(wait("batch", 2)), asyncio.create_task(wait("crit", 0))]
        while len(slots.queue) < 2:  # bounded by the two tasks reaching their acquire
            await asyncio.sleep(0)
        assert slots.busy == 1
        slots.release()
        await asyncio.gather(*tasks)
        assert slots.busy == 0
        return order

    assert asyncio.run(run()) == ["crit", "batch"]


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    async def run() -> None:
        slots = EngineSlots(1, 0.7, FakeClock())
        await slots.acquire(0, 1.0)
        task = asyncio.create_task(slots.acquire(0, 1.0))
        while not len(slots.queue):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not len(slots.queue)
        slots.release()
        assert slots.busy == 0

    asyncio.run(run())
