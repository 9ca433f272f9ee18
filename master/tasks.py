"""Tasks the master gives nodes (moves between tiers, copies between nodes), with deadlines.

A task is planned by the tier manager or the replicator, queued in the executing node's outbox,
handed out in that node's heartbeat reply, and settled when the node reports it done or when
its deadline passes. Its destination space is allocated at planning time; the object is marked
busy so nothing else plans work on it at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

#: Why a task exists; decides what its completion changes.
PURPOSE_DEMOTE = "demote"
PURPOSE_PROMOTE = "promote"
PURPOSE_REPLICATE = "replicate"
PURPOSE_DRAIN = "drain"

#: The master gives a task up this long after the deadline it sent the node (which then refuses
#: to store it): so a node never stores into space the master already handed to someone else.
TASK_GRACE_S = 2.0


@dataclass(slots=True)
class Task:
    task_id: int
    purpose: str
    node_id: str  # the node that runs it (the destination's node)
    key: bytes
    src: Any  # the source Replica
    dst: Any  # the destination Replica (allocated)
    deadline: float
    wire: dict[str, Any] = field(default_factory=dict)


class TaskBook:
    """Tasks by id, and each node's queue of tasks not yet handed out."""

    def __init__(self) -> None:
        self.by_id: dict[int, Task] = {}
        self.outbox: dict[str, list[int]] = {}
        self._ids = itertools.count(1)
        self.num_done = 0
        self.num_failed = 0

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, task: Task) -> None:
        self.by_id[task.task_id] = task
        self.outbox.setdefault(task.node_id, []).append(task.task_id)

    def take(self, node_id: str, limit: int, max_bytes: int) -> list[dict[str, Any]]:
        """Queued tasks of ``node_id`` in their wire form: at most ``limit`` of them and (past
        the first) ``max_bytes`` of objects, so a node's heartbeat thread is never busy for
        long enough to be declared dead."""
        queue = self.outbox.get(node_id)
        if not queue:
            return []
        out: list[dict[str, Any]] = []
        num_bytes = taken = 0
        for task_id in queue:
            task = self.by_id.get(task_id)
            taken += 1
            if task is None:
                continue  # settled before it was handed out
            if out and (len(out) >= limit or num_bytes + task.dst.size > max_bytes):
                taken -= 1
                break
            out.append(task.wire)
            num_bytes += task.dst.size
        self.outbox[node_id] = queue[taken:]
        return out

    def pop(self, task_id: int) -> Task | None:
        return self.by_id.pop(task_id, None)

    def expired(self, now: float) -> list[Task]:
        return [t for t in self.by_id.values() if t.deadline <= now]

    def count(self, purpose: str) -> int:
        return sum(1 for t in self.by_id.values() if t.purpose == purpose)
