"""Highly available masters: leader election, fencing and node membership through etcd.

Every master of a cluster runs :class:`Elector`. It campaigns with a compare-and-swap on the
leader key, attached to a lease of its own (TTL ``lease_ttl_s``). The winner's **epoch** is the
key's create revision. The winner publishes its control address in the key's value; standbys
watch the key and campaign again when it goes (its lease expired, or the leader resigned).

Fencing (:class:`Leadership`, checked before any handler runs):

- a standby answers every verb but ``ping`` with ``NOT_LEADER``;
- the leader keeps its lease alive explicitly and records, with its own monotonic clock, the
  latest moment the lease is certainly still valid (the time it *sent* the last successful
  keep-alive plus the TTL, less a margin). Past that moment it serves nothing: a leader that was
  paused (SIGSTOP), partitioned or starved cannot tell whether another master took over, so it
  refuses, and steps down for good once etcd says its lease is gone;
- a request names the epoch its sender believes in: an older one gets ``STALE_EPOCH`` (the
  caller re-resolves), a newer one proves that another master won, so this one steps down;
- the admin API obeys the same fence (:meth:`Leadership.admin_check`): its mutating routes and
  ``/ready`` refuse with ``NOT_LEADER``, and a fenced leader's housekeeping changes nothing.

etcd hiccups (a pause, a restart, a partition) never leave a master stuck: each background task
has its own etcd client (a failed call closes its channel, and grpc cancels every call on it),
renewals are retried within a fraction of the TTL, a lease etcd dropped makes the leader a
standby that campaigns again, and :func:`supervise` logs and restarts any task that ends anyway.

A new leader starts with an empty table and rebuilds it from the manifests the nodes send when
they register (``recovery.py``); for up to ``recovery_s`` it waits for every node etcd lists as
alive before it serves puts and reads, so a read does not miss an object only because its node
has not re-registered yet. The leader also watches node membership: a node whose etcd lease
expired (crashed, partitioned) is dropped at once, without waiting for heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvstore import protocol
from kvstore.address import Address
from kvstore.errors import (
    EtcdUnavailableError,
    InvalidRequestError,
    KVStoreError,
    NotLeaderError,
    StaleEpochError,
)
from kvstore.etcd import EtcdStore, KeyValue, self_cancelled
from kvstore.etcd_keys import DEFAULT_PREFIX, EtcdLayout, LeaderRecord, read_members
from kvstore.master.service import MasterService, ServiceSlot

log = logging.getLogger(__name__)

#: Fraction of the TTL the leader trusts its lease for after a keep-alive (clock-rate margin).
LEASE_SAFETY = 0.8
#: Verbs a leader serves while it waits for nodes to re-register.
RECOVERY_VERBS = frozenset({"ping", "register", "heartbeat", "stats"})
MEMBERSHIP_POLL_S = 0.25
#: First retry after a failed lease renewal (then doubling, up to TTL / 8).
KEEP_ALIVE_RETRY_S = 0.05
CAMPAIGN_BACKOFF_S = 0.1
MAX_CAMPAIGN_BACKOFF_S = 1.0


@dataclass(frozen=True, slots=True)
class HAConfig:
    """How a master takes part in elections. Validated on creation."""

    endpoints: list[Address]
    prefix: str = DEFAULT_PREFIX
    lease_ttl_s: int = 2
    recovery_s: float = 1.5
    connect_attempts: int = 5
    advertise_host: str = ""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise InvalidRequestError("--etcd needs at least one HOST:PORT")
        if self.lease_ttl_s < 1:
            raise InvalidRequestError("--lease-ttl must be at least 1 second")
        if self.recovery_s < 0 or self.connect_attempts < 1:
            raise InvalidRequestError("recovery time must be >= 0 and connect attempts >= 1")
        EtcdLayout(self.prefix)


@dataclass(slots=True)
class Leadership:
    """The fence: whether this master may serve, checked before every request.

    Each term starts a fresh service in ``slot`` (:meth:`begin`), and so does stepping down: a
    standby holds an empty table, and a new leader never sees a row of an earlier term's.

    NOTE: only the master's event loop touches it (checks, elections, keep-alives).
    """

    slot: ServiceSlot
    clock: Callable[[], float] = time.monotonic
    epoch: int = 0
    leading: bool = False
    deadline: float = 0.0
    recovering_until: float = 0.0
    expected_nodes: set[str] | None = None  # live nodes per etcd when elected; None: not read yet
    lost: asyncio.Event | None = None
    num_refused: int = 0

    @property
    def service(self) -> MasterService:
        """The service of the current term."""
        return self.slot.service

    def begin(self, epoch: int, deadline: float, recovery_s: float) -> None:
        # A fresh service for the term: its put ids never collide with an earlier term's, even
        # for a caller that ignores epochs, and its KV events carry the epoch (a subscriber of
        # the last leader resyncs).
        self.slot.next_term(epoch)
        self.epoch = epoch
        self.deadline = deadline
        self.recovering_until = self.clock() + recovery_s
        self.expected_nodes = None
        self.leading = True
        self.lost = asyncio.Event()

    def step_down(self, why: str) -> None:
        if self.leading:
            log.warning("stepping down from epoch %d: %s", self.epoch, why)
            print(f"kvstore master standby: epoch={self.epoch} reason={why}", flush=True)
        self.leading = False
        self.slot.next_term()
        if self.lost is not None:
            self.lost.set()

    def recovering(self, now: float) -> bool:
        """Whether the leader still waits for nodes to re-register (ends the wait when every
        node etcd listed is back, or the recovery time is over)."""
        if not self.recovering_until:
            return False
        expected = self.expected_nodes
        if now >= self.recovering_until or (
            expected is not None and expected <= self.service.nodes.keys()
        ):
            self.recovering_until = 0.0
            log.info(
                "epoch %d: serving with %d node(s) and %d object(s) rebuilt from manifests",
                self.epoch,
                len(self.service.nodes),
                len(self.service.objects),
            )
            print(
                f"kvstore master serving: epoch={self.epoch} nodes={len(self.service.nodes)} "
                f"objects={len(self.service.objects)}",
                flush=True,
            )
            return False
        return True

    def check(self, request: protocol.Request) -> KVStoreError | None:
        """None when this master may serve ``request``, else the error to answer with."""
        if request.verb == "ping":
            return None
        err = self._refusal(request)
        if err is not None:
            self.num_refused += 1
        return err

    def admin_check(self) -> KVStoreError | None:
        """None when the admin API may change the cluster (or say it is ready), else the error.

        The same fence as the control protocol: a standby, a leader that cannot prove its lease
        and a leader still rebuilding its table refuse, so a leader cut from etcd deletes or
        evicts nothing from its stale table while another master leads.
        """
        now = self.clock()
        err = self._lease_refusal(now)
        if err is None and self.recovering(now):
            err = NotLeaderError("the new leader is rebuilding its table; retry")
        return err

    def lease_proven_again(self) -> None:
        """The lease held through an etcd outage: restart every node's heartbeat clock.

        While this leader could not prove its lease it refused every heartbeat: its nodes were
        not silent, it was deaf. Without this, they would be declared dead (and their objects
        read as misses until they register again) the moment it serves again.
        """
        self.service.leader_heard_again()

    def _lease_refusal(self, now: float) -> KVStoreError | None:
        if not self.leading:
            return NotLeaderError("this master is not the leader")
        if now >= self.deadline:
            # We cannot prove our lease is alive: another master may lead by now. Refuse; the
            # keep-alive loop steps down for good or resumes once etcd answers.
            return NotLeaderError("the leader's lease could not be renewed in time")
        return None

    def _refusal(self, request: protocol.Request) -> KVStoreError | None:
        now = self.clock()
        err = self._lease_refusal(now)
        if err is not None:
            return err
        caller = request.args.get("epoch")
        if isinstance(caller, int) and not isinstance(caller, bool):
            if caller > self.epoch:
                self.step_down(f"a caller knows a newer epoch {caller}")
                return NotLeaderError(f"epoch {self.epoch} was superseded by {caller}")
            if caller < self.epoch:
                return StaleEpochError(f"epoch {caller} is stale; the leader's is {self.epoch}")
        if self.recovering(now) and request.verb not in RECOVERY_VERBS:
            return NotLeaderError("the new leader is rebuilding its table; retry")
        return None


async def supervise(
    name: str,
    make: Callable[[], Awaitable[None]],
    alive: Callable[[], bool],
    *,
    backoff_s: float = 0.1,
    max_backoff_s: float = 1.0,
) -> None:
    """Run ``make()`` again, with backoff, whenever it ends while ``alive()``; say why each time.

    A background task that ends (an etcd call cancelled under it, a bug) must not leave the
    master half working: this logs and restarts it. Only a cancellation of this very task ends
    the supervision.
    """
    backoff = backoff_s
    while alive():
        try:
            await make()
            if not alive():
                return
            log.error("%s ended on its own; restarting it", name)
        except asyncio.CancelledError:
            if self_cancelled():
                raise
            log.warning("%s: a call was cancelled under it; restarting it", name)
        except EtcdUnavailableError as err:
            log.warning("%s: %s; restarting it in %.1fs", name, err.message, backoff)
        except Exception:
            log.exception("%s failed; restarting it", name)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, max_backoff_s)


class Elector:
    """Campaigns for leadership and, while leading, keeps the lease and watches membership.

    NOTE: one etcd client per task. A failed call closes its store's gRPC channel, and grpc
    cancels every other call on that channel: shared, a membership read timing out during an
    etcd pause cancelled the lease keep-alive, which then ended while the leader waited for it.

    Args:
        store: a connected etcd store (the campaign's own).
        config: election settings.
        fence: the leadership state the control server checks.
        control, admin: this master's addresses, published when it leads.
    """

    def __init__(
        self,
        store: EtcdStore,
        config: HAConfig,
        fence: Leadership,
        control: str,
        admin: str,
        on_lead: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.store = store
        #: Run at the start of each term this master leads (the tenants are read from etcd).
        self.on_lead = on_lead
        self.config = config
        self.layout = EtcdLayout(config.prefix)
        self.fence = fence
        self.record = LeaderRecord.encode(control, admin)
        self.clock = fence.clock
        # A keep-alive must fail fast enough to retry a few times within one TTL.
        self.lease_store = EtcdStore(
            config.endpoints, op_timeout=min(store.op_timeout, max(0.5, config.lease_ttl_s / 2))
        )
        self.members_store = EtcdStore(config.endpoints, op_timeout=store.op_timeout)

    async def close(self) -> None:
        """Close the clients this elector opened (not the campaign store it was given)."""
        await self.lease_store.close()
        await self.members_store.close()

    async def run(self) -> None:
        """Campaign until cancelled: whatever etcd does, a standby campaigns again."""
        await supervise("the election", self._campaign_forever, lambda: True)

    async def _campaign_forever(self) -> None:
        backoff = CAMPAIGN_BACKOFF_S
        while True:
            try:
                await self._campaign_once()
                backoff = CAMPAIGN_BACKOFF_S
                continue
            except EtcdUnavailableError as err:
                log.warning("election: %s; retrying in %.1fs", err.message, backoff)
            finally:
                if self.fence.leading:  # never a leader without the task that proves it
                    self.fence.step_down("the campaign ended")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_CAMPAIGN_BACKOFF_S)

    async def _campaign_once(self) -> None:
        t_grant = self.clock()
        lease = await self.store.grant_lease(self.config.lease_ttl_s)
        try:
            won, kv = await self.store.create_if_absent(
                self.layout.leader_key, self.record, lease.lease_id
            )
        except BaseException:
            await self.store.revoke_lease(lease.lease_id)
            raise
        if not won:
            await self.store.revoke_lease(lease.lease_id)
            await self._wait_for_vacancy(kv)
            return
        assert kv is not None, "a key we just created vanished"
        await self._lead(lease.lease_id, lease.ttl, kv.create_revision, t_grant)

    async def _wait_for_vacancy(self, kv: KeyValue | None) -> None:
        """Wait (watching the key) until the leader key is gone, or a bounded while."""
        if kv is None:
            return
        if kv.lease == 0:
            # Not ours: a leader key always carries a lease. Remove that one incarnation.
            log.warning(
                "foreign value under %s (no lease): removing it", self.layout.leader_key.decode()
            )
            await self.store.delete_if_created_at(self.layout.leader_key, kv.create_revision)
            return
        watch = await self.store.watch(self.layout.leader_key, start_revision=kv.mod_revision + 1)

        async def deleted() -> None:
            async for ev in watch.events():
                if ev.kind == "delete":
                    return

        try:
            await asyncio.wait_for(deleted(), self.config.lease_ttl_s * 2)
        except TimeoutError:
            pass  # campaign again: it re-reads the key
        finally:
            await watch.cancel()

    async def _lead(self, lease_id: int, ttl: int, epoch: int, t_grant: float) -> None:
        fence = self.fence
        fence.begin(epoch, t_grant + ttl * LEASE_SAFETY, self.config.recovery_s)
        log.info("elected leader with epoch %d (lease TTL %ds)", epoch, ttl)
        print(f"kvstore master leading: epoch={epoch}", flush=True)
        lost = fence.lost
        assert lost is not None

        def leading() -> bool:
            return fence.lost is lost and not lost.is_set()

        keep_alive = asyncio.create_task(self._keep_alive(lease_id, ttl, epoch))
        tasks = [
            keep_alive,
            asyncio.create_task(supervise("the membership watch", self._watch_members, leading)),
            asyncio.create_task(self._finish_recovery()),
        ]
        if self.on_lead is not None:
            tasks.append(asyncio.create_task(self._run_on_lead(self.on_lead, leading)))
        waiting = asyncio.create_task(lost.wait())
        try:
            await asyncio.wait([waiting, keep_alive], return_when=asyncio.FIRST_COMPLETED)
            if keep_alive.done() and leading():
                # Without its keep-alive a leader would fence itself forever: campaign again.
                why = "the lease keep-alive ended"
                if not keep_alive.cancelled() and keep_alive.exception() is not None:
                    log.error("lease keep-alive failed", exc_info=keep_alive.exception())
                fence.step_down(why)
        finally:
            for t in [waiting, *tasks]:
                t.cancel()
            for t in [waiting, *tasks]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            fence.step_down("leadership ended")
            await self.lease_store.revoke_lease(lease_id)

    async def _keep_alive(self, lease_id: int, ttl: int, epoch: int) -> None:
        """Renew the lease until it is gone, whatever etcd does meanwhile (never ends early).

        Failed renewals are retried quickly: once etcd answers again, a lease it dropped is
        seen (and the leader steps down) within one retry, far inside one TTL.
        """
        fence = self.fence
        store = self.lease_store
        interval = max(0.1, ttl / 4)
        retry = KEEP_ALIVE_RETRY_S
        suspended = False
        while fence.leading:
            t_send = self.clock()
            try:
                remaining = await store.keep_alive(lease_id)
                if remaining > 0 and suspended:
                    # etcd was away: the lease survived, but check the key is still ours.
                    kv = await store.get(self.layout.leader_key)
                    if kv is None or kv.create_revision != epoch:
                        fence.step_down("the leader key changed while etcd was away")
                        return
                    log.info("etcd is back; the lease held: still leading epoch %d", epoch)
            except EtcdUnavailableError as err:
                if not suspended:
                    log.warning("lease keep-alive failed (%s); retrying", err.message)
                suspended = True
                await asyncio.sleep(retry)
                retry = min(retry * 2, max(KEEP_ALIVE_RETRY_S, ttl / 8))
                continue
            if remaining <= 0:
                fence.step_down("the lease expired")
                return
            suspended = False
            retry = KEEP_ALIVE_RETRY_S
            if self.clock() >= fence.deadline:
                fence.lease_proven_again()  # it refused heartbeats until now
            fence.deadline = max(fence.deadline, t_send + remaining * LEASE_SAFETY)
            await asyncio.sleep(interval)

    @staticmethod
    async def _run_on_lead(
        on_lead: Callable[[], Awaitable[object]], leading: Callable[[], bool]
    ) -> None:
        """Run ``on_lead`` once, retried with backoff while this term lasts if it fails."""
        backoff = CAMPAIGN_BACKOFF_S
        while leading():
            try:
                await on_lead()
                return
            except EtcdUnavailableError as err:
                log.warning("reading the term's state: %s; retrying in %.1fs", err.message, backoff)
            except Exception:
                log.exception("reading the term's state failed; retrying")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_CAMPAIGN_BACKOFF_S)

    async def _finish_recovery(self) -> None:
        while self.fence.leading and self.fence.recovering(self.clock()):
            await asyncio.sleep(0.02)

    async def _watch_members(self) -> None:
        """Track live nodes in etcd; drop a registered node whose lease is gone."""
        fence = self.fence
        seen: set[str] = set()
        first = True
        while fence.leading:
            try:
                members = await read_members(self.members_store, self.layout)
            except EtcdUnavailableError:
                await asyncio.sleep(MEMBERSHIP_POLL_S)
                continue
            svc = fence.service
            if first:
                fence.expected_nodes = set(members)
                first = False
            seen |= members.keys() & svc.nodes.keys()
            for node_id in [n for n in svc.nodes if n in seen and n not in members]:
                log.warning("node %s left etcd membership (lease expired): dropped", node_id)
                svc.drop_dead_node(node_id)
                seen.discard(node_id)
            await asyncio.sleep(MEMBERSHIP_POLL_S)
