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

    def take(self, node_id: str, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` queued tasks of ``node_id``, in their wire form."""
        queue = self.outbox.get(node_id)
        if not queue:
            return []
        ids, self.outbox[node_id] = queue[:limit], queue[limit:]
        return [self.by_id[i].wire for i in ids if i in self.by_id]

    def pop(self, task_id: int) -> Task | None:
        return self.by_id.pop(task_id, None)

    def expired(self, now: float) -> list[Task]:
        return [t for t in self.by_id.values() if t.deadline <= now]

    def count(self, purpose: str) -> int:
        return sum(1 for t in self.by_id.values() if t.purpose == purpose)
