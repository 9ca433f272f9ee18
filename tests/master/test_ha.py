"""The leadership fence, driven by a fake clock: who may serve, and when a leader steps down."""

from __future__ import annotations

import asyncio

import pytest

from kvstore import protocol
from kvstore.address import Address
from kvstore.errors import ErrorCode, EtcdUnavailableError, InvalidRequestError
from kvstore.master.ha import HAConfig, Leadership, supervise
from kvstore.master.service import MasterService, ServiceSlot
from kvstore.types import SegmentSpec


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def req(verb: str, **args: object) -> protocol.Request:
    return protocol.Request(1, verb, dict(args))


@pytest.fixture
def fence() -> Leadership:
    return Leadership(ServiceSlot(MasterService()), clock=Clock())


def code(err: object) -> ErrorCode | None:
    return getattr(err, "code", None)


def test_a_standby_serves_only_ping(fence: Leadership) -> None:
    assert fence.check(req("ping")) is None
    for verb in ("put_start", "put_end", "get_locations", "register", "heartbeat", "stats"):
        assert code(fence.check(req(verb))) == ErrorCode.NOT_LEADER


def test_a_leader_past_its_lease_deadline_refuses_everything(fence: Leadership) -> None:
    async def run() -> None:
        fence.begin(epoch=7, deadline=105.0, recovery_s=0)
        fence.expected_nodes = set()
        assert fence.check(req("put_start", epoch=7)) is None
        fence.clock.now = 105.0  # type: ignore[attr-defined]
        assert code(fence.check(req("put_start", epoch=7))) == ErrorCode.NOT_LEADER
        assert code(fence.check(req("put_end", epoch=7))) == ErrorCode.NOT_LEADER

    asyncio.run(run())


def test_epochs(fence: Leadership) -> None:
    async def run() -> None:
        fence.begin(epoch=7, deadline=1e9, recovery_s=0)
        fence.expected_nodes = set()
        assert code(fence.check(req("get_locations", epoch=6))) == ErrorCode.STALE_EPOCH
        assert fence.leading
        # A caller that knows a newer leader proves this one was deposed.
        assert code(fence.check(req("get_locations", epoch=8))) == ErrorCode.NOT_LEADER
        assert not fence.leading and fence.lost is not None and fence.lost.is_set()
        assert code(fence.check(req("get_locations", epoch=7))) == ErrorCode.NOT_LEADER

    asyncio.run(run())


def test_a_new_leader_waits_for_known_nodes_before_serving_reads(fence: Leadership) -> None:
    async def run() -> None:
        fence.begin(epoch=3, deadline=1e9, recovery_s=5.0)
        assert code(fence.check(req("get_locations", epoch=3))) == ErrorCode.NOT_LEADER
        assert fence.check(req("register", epoch=3)) is None
        fence.expected_nodes = {"n1"}
        assert code(fence.check(req("put_start", epoch=3))) == ErrorCode.NOT_LEADER
        fence.service.register("n1", "h", 1, b"x" * 16, [SegmentSpec("dram", "dram", 1024)])
        assert fence.check(req("put_start", epoch=3)) is None

    asyncio.run(run())


def test_recovery_is_bounded(fence: Leadership) -> None:
    async def run() -> None:
        fence.begin(epoch=3, deadline=1e9, recovery_s=1.0)
        fence.expected_nodes = {"never-comes"}
        fence.clock.now += 1.0  # type: ignore[attr-defined]
        assert fence.check(req("get_locations", epoch=3)) is None

    asyncio.run(run())


@pytest.mark.parametrize(
    "kwargs",
    [{"endpoints": []}, {"lease_ttl_s": 0}, {"prefix": "no-slash"}, {"connect_attempts": 0}],
)
def test_ha_config_is_validated(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"endpoints": [Address("127.0.0.1", 2379)], **kwargs}
    with pytest.raises(InvalidRequestError):
        HAConfig(**args)  # type: ignore[arg-type]


def test_the_admin_api_obeys_the_same_fence(fence: Leadership) -> None:
    assert code(fence.admin_check()) == ErrorCode.NOT_LEADER  # a standby

    async def run() -> None:
        fence.begin(epoch=4, deadline=110.0, recovery_s=5.0)
        fence.expected_nodes = {"n1"}
        assert code(fence.admin_check()) == ErrorCode.NOT_LEADER  # still rebuilding
        fence.service.register("n1", "h", 1, b"x" * 16, [SegmentSpec("dram", "dram", 1024)])
        assert fence.admin_check() is None
        fence.clock.now = 110.0  # type: ignore[attr-defined]
        assert code(fence.admin_check()) == ErrorCode.NOT_LEADER  # cannot prove its lease

    asyncio.run(run())


def test_supervise_restarts_a_task_that_ended_until_cancelled() -> None:
    """A background task that fails, ends, or has a call cancelled under it is run again."""
    runs: list[str] = []

    async def flaky() -> None:
        runs.append("run")
        if len(runs) == 1:
            raise RuntimeError("a bug")
        if len(runs) == 2:
            raise asyncio.CancelledError  # grpc cancelling a call under the task
        if len(runs) == 3:
            raise EtcdUnavailableError("etcd away")
        if len(runs) == 4:
            return  # ended on its own while it should run
        await asyncio.Event().wait()  # runs until the supervisor is cancelled

    async def run() -> None:
        task = asyncio.create_task(supervise("flaky", flaky, lambda: True, backoff_s=0.001))

        async def five_runs() -> None:
            while len(runs) < 5:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(five_runs(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        done = asyncio.create_task(supervise("done", flaky, lambda: False))
        await done  # nothing to supervise once not alive

    asyncio.run(run())
    assert len(runs) == 5
