"""Work the master hands a node in its heartbeat reply: moves between tiers and copies from peers.

How the master tells nodes what to do: the heartbeat reply carries ``tasks``; the node runs them
in its link thread and reports ``done`` in its next heartbeat, which it sends at once when it ran
any (so a busy master keeps its nodes busy without waiting for the heartbeat interval). The
master changes no replica until the node reports success, so a lost task only costs a timeout.

Task (a dict on the wire)::

    {"id": int, "kind": "move",  "key": bytes, "size": int, "checksum": int,
     "src": [segment, offset], "dst": [segment, offset]}          # same node, another tier
    {"id": int, "kind": "fetch", "key": bytes, "size": int, "checksum": int,
     "from": location, "dst": [segment, offset]}                  # from a peer, with a read grant

Result: ``[id, code, message]`` (code 0 on success). Every copy is checked against the object's
checksum before it is stored, so a task can never store other bytes under a key. A task past its
``deadline_ms`` (wall clock) is not stored: the master has given its destination up by then and
may have handed that space to someone else.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvstore import protocol
from kvstore.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    KVStoreError,
    KVTimeoutError,
    NodeUnavailableError,
    ProtocolError,
)
from kvstore.node.tiers import checksum_of
from kvstore.stored_object import StoredObject
from kvstore.types import TIERS_BY_ID, Location, result_from_wire

if TYPE_CHECKING:
    from kvstore.node.server import DataServer

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 30.0


def _fetch(location: Location, size: int) -> memoryview:
    """Read one whole object from a peer node with the master's read grant."""
    try:
        conn = protocol.FramedSocket.connect(location.host, location.port, timeout=FETCH_TIMEOUT_S)
    except KVStoreError as err:
        raise NodeUnavailableError(f"peer {location.node_id} unreachable: {err.message}") from None
    try:
        req_id = conn.send_request("read", {"items": [[location.grant.to_wire(), None]]})
        response, payload_len = conn.read_response()
        if response.req_id != req_id:
            raise ProtocolError("peer answered another request")
        result = response.unwrap()
        err, length = result_from_wire(result[0])
        if err is not None:
            raise err
        if length != size or payload_len != size:
            raise ProtocolError(f"peer sent {payload_len} bytes, expected {size}")
        buf = memoryview(bytearray(size))
        conn.recv_into(buf)
        return buf
    except (OSError, ConnectionError) as exc:
        raise NodeUnavailableError(f"peer {location.node_id} failed: {exc}") from None
    finally:
        conn.close()


def run_tasks(server: DataServer, tasks: list[Any]) -> list[list[Any]]:
    """Run the master's tasks; returns one ``[id, code, message]`` per task.

    Writes are grouped per destination segment, so moves into NVMe share one transaction.
    """
    results: list[list[Any]] = []
    batches: dict[str, list[tuple[int, StoredObject, memoryview]]] = {}
    deadlines: dict[int, int] = {}
    for task in tasks:
        task_id = task.get("id") if isinstance(task, dict) else None
        try:
            if not isinstance(task_id, int):
                raise InvalidRequestError("task without an id")
            kind = task.get("kind")
            deadline_ms = int(task.get("deadline_ms", 1 << 62))
            if server.clock_ms() > deadline_ms:
                raise KVTimeoutError("task arrived after its deadline")
            key, size, checksum = task["key"], int(task["size"]), int(task["checksum"])
            dst_segment, dst_offset = task["dst"]
            if kind == "move":
                src_segment, src_offset = task["src"]
                data = server.read_object(src_segment, int(src_offset), size)
            elif kind == "fetch":
                data = _fetch(Location.from_wire(task["from"]), size)
            else:
                raise InvalidRequestError(f"unknown task kind {kind!r}")
            if checksum_of(data) != checksum:
                raise ChecksumMismatchError(f"source bytes of {key[:64]!r} fail their checksum")
            obj = StoredObject(
                dst_segment, int(dst_offset), key, size, checksum, int(task.get("stamp", 0))
            )
            # NOTE: a DRAM source view stays valid: the master frees the source only after the
            # node reports this task done.
            deadlines[len(results)] = deadline_ms
            batches.setdefault(dst_segment, []).append((len(results), obj, data))
            results.append([task_id, 0, None])
        except KVStoreError as err:
            results.append([task_id, int(err.code), err.message])
        except (KeyError, TypeError, ValueError) as exc:
            results.append([task_id, int(InvalidRequestError.code), f"malformed task: {exc}"])
    for segment, batch in batches.items():
        now_ms = server.clock_ms()
        late = [i for i, _, _ in batch if now_ms > deadlines[i]]
        for i in late:
            results[i] = [results[i][0], int(KVTimeoutError.code), "task passed its deadline"]
        batch = [b for b in batch if b[0] not in late]
        batch = _claim_destinations(server, segment, batch, tasks, results)
        errs = server.store_objects(segment, [(obj, data) for _, obj, data in batch])
        for (i, _, _), err in zip(batch, errs, strict=True):
            if err is not None:
                results[i] = [results[i][0], int(err.code), err.message]
    return results


def _claim_destinations(
    server: DataServer,
    segment: str,
    batch: list[tuple[int, StoredObject, memoryview]],
    tasks: list[Any],
    results: list[list[Any]],
) -> list[tuple[int, StoredObject, memoryview]]:
    """Claim each byte-addressed destination for its task's new allocation before storing, so
    no write grant of an earlier allocation of those bytes can land on them afterwards (see
    ``kvstore.node.claims.WriteClaims``). NVMe and shared destinations are fresh ids: nothing to fence."""
    tier = server.tiers.get(segment)
    if tier is not None and tier.tier in TIERS_BY_ID:
        return batch
    kept = []
    for i, obj, data in batch:
        task = tasks[i]
        stamp = task.get("claim_ms")
        if not isinstance(stamp, int) or isinstance(stamp, bool):
            kept.append((i, obj, data))  # (an older master: no claim)
            continue
        try:
            claim = server.claims.claim(
                segment, obj.offset, obj.offset + max(1, obj.size), stamp, b"task:%d" % task["id"]
            )
            server.claims.end(claim, None, complete=True)
        except KVStoreError as err:
            results[i] = [results[i][0], int(err.code), err.message]
            continue
        kept.append((i, obj, data))
    return kept
